"""Harbor 0.25.0's EnvironmentConfig: the task.toml [environment] fields the adapter reads."""

from pydantic import BaseModel, Field


class EnvironmentConfig(BaseModel):
    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    cpus: int | float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    gpus: int | None = None
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    allow_internet: bool | None = None
