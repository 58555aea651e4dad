"""Harbor 0.25.0's EnvironmentCapabilities (the flags a provider declares)."""

from pydantic import BaseModel


class EnvironmentCapabilities(BaseModel):
    stream: bool = False
    gpus: bool = False
    tpus: bool = False
    disable_internet: bool = False
    network_allowlist: bool = False
    mounted: bool = False
    docker_compose: bool = False
    dynamic_network_policy: bool = False
