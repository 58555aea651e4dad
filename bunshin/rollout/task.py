"""Task specs: what one rollout group runs in, and how its outcome is scored.

A task file (YAML or JSON) looks like::

    id: fix-parser
    image: host                 # 'host', a root filesystem folder, or an image (REGISTRY/NAME:TAG[@sha256:...]
                                # pulled on first use; name:tag or an id of the store)
    memory: 1G
    files: {/work/hello.py: "print('hi')\\n"}   # written before setup
    mounts: ["/srv/data:/data"]  # host folders shared on purpose: HOST:PATH[:ro|rw] (ro default)
    setup:                      # run once per task root (per trajectory in baseline mode)
      - pip --version
      - {run: "python3 /opt/server.py", background: true}
      - {tool: python, arguments: {code: "import json; data = json.load(open('/data.json'))"}}
    tools: [bash, read_file, write_file]        # omit for every tool of the tool set
    workdir: /work              # relative paths and new shells start here
    prompt: "Make the tests pass."
    max_turns: 20
    reward: "python3 /work/score.py"            # its stdout's last number is the reward
    call_timeout: 60            # seconds per tool call (finite, at most 7 days, as every timeout)
    trajectory_timeout: 600     # seconds per trajectory, setup included
    desktop: true               # a desktop (Xvfb + jwm) started before setup: true, "1280x800x24" or
                                # a mapping of DesktopSpec fields (bunshin.workspace.desktop)
    network: egress             # none (loopback only, the default) or egress: NAT out under
    allow: [198.51.100.0/24]    # allow/deny: CIDRs and addresses (names: docs/guides/network.md)
    deny: [203.0.113.0/24]

A bad spec raises :class:`~bunshin.errors.InvalidArgument` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config import Config
from ..errors import InvalidArgument
from ..runtime.kernel.limits import MAX_TIMEOUT_S
from ..runtime.net.policy import NetworkMode, Policy
from ..runtime.state.budget import MIN_PIDS, PID_MAX_LIMIT
from ..runtime.state.records import check_mounts
from ..workspace.desktop import DesktopSpec

#: A timeout field: finite seconds, > 0 and at most 7 days (``MAX_TIMEOUT_S``).
TimeoutSeconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)]

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:inf|nan)\b", re.I)


class SetupStep(BaseModel):
    """One setup step: a shell command (``run``), or a tool call (``tool`` + ``arguments``).

    ``background`` starts the command and does not wait (a server). A tool call goes
    through the task's tool set, e.g. ``{tool: python, arguments: {code: "df = load()"}}``
    loads data into the persistent interpreter every trajectory then starts from.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str | None = Field(default=None, min_length=1)
    tool: str | None = Field(default=None, min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    background: bool = False
    timeout: TimeoutSeconds = 600.0

    @model_validator(mode="after")
    def _one_kind(self) -> SetupStep:
        if (self.run is None) == (self.tool is None):
            raise ValueError("a setup step has either 'run' (a command) or 'tool' (a tool call)")
        if self.tool is not None and self.background:
            raise ValueError("'background' applies to commands only")
        return self

    def describe(self) -> str:
        return self.run[:80] if self.run is not None else f"{self.tool} {str(self.arguments)[:60]}"


class RewardSpec(BaseModel):
    """The command run in the final workspace; the last number on its stdout is the reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str = Field(min_length=1)
    timeout: TimeoutSeconds = 120.0


class TaskSpec(BaseModel):
    """One task: the workspace a group starts from, its tools, limits and reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    image: str = "host"
    memory: str | int | None = "2G"
    pids: int | None = Field(default=512, ge=MIN_PIDS, le=PID_MAX_LIMIT)
    files: dict[str, str] = Field(default_factory=dict)
    mounts: tuple[str, ...] = ()  # checked, as "HOST:PATH:ro|rw"
    setup: tuple[SetupStep, ...] = ()
    tools: tuple[str, ...] | None = None
    workdir: str = Field(default="/", pattern=r"^/")
    system: str | None = None
    prompt: str = ""
    max_turns: int = Field(default=20, ge=1)
    reward: RewardSpec | None = None
    call_timeout: TimeoutSeconds = 60.0
    trajectory_timeout: TimeoutSeconds = 600.0
    metadata: dict[str, Any] = Field(default_factory=dict)
    desktop: dict[str, Any] | None = None  # a DesktopSpec's fields (true and "WxH[xD]" accepted)
    network: NetworkMode = NetworkMode.NONE
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @field_validator("setup", mode="before")
    @classmethod
    def _steps(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list | tuple):
            return [{"run": s} if isinstance(s, str) else s for s in v]
        return v

    @field_validator("desktop", mode="before")
    @classmethod
    def _desktop(cls, v: Any) -> Any:
        try:
            spec = DesktopSpec.parse(v)
        except InvalidArgument as e:
            raise ValueError(str(e)) from None
        return None if spec is None else spec.to_dict()

    @field_validator("reward", mode="before")
    @classmethod
    def _reward(cls, v: Any) -> Any:
        return {"command": v} if isinstance(v, str) else v

    @field_validator("mounts", mode="before")
    @classmethod
    def _mounts(cls, v: Any) -> Any:
        if not isinstance(v, list | tuple):
            raise ValueError("a list of HOST:PATH[:ro|rw] strings or {host, path, read_only} mappings")
        try:
            return tuple(str(m) for m in check_mounts(v))
        except InvalidArgument as e:
            raise ValueError(str(e)) from None

    @field_validator("files")
    @classmethod
    def _abs_paths(cls, v: dict[str, str]) -> dict[str, str]:
        for path in v:
            if not path.startswith("/"):
                raise ValueError(f"path {path!r} must be absolute")
        return v

    @model_validator(mode="after")
    def _tools_unique(self) -> TaskSpec:
        if self.tools is not None and len(set(self.tools)) != len(self.tools):
            raise ValueError("tools: a tool is named twice")
        return self

    @model_validator(mode="after")
    def _network_rules(self) -> TaskSpec:
        if (self.allow or self.deny) and self.network != NetworkMode.EGRESS:
            raise ValueError("allow/deny rules need network: egress")
        try:
            Policy.of(self.allow, self.deny)
        except InvalidArgument as e:
            raise ValueError(e.message) from None
        return self

    def network_kwargs(self) -> dict[str, Any]:
        """The workspace's network as ``create`` arguments; empty for ``none``."""
        if self.network == NetworkMode.NONE:
            return {}
        return {"network": self.network.value, "allow": list(self.allow), "deny": list(self.deny)}

    def root_key(self, image_id: str) -> str:
        """The key of this task's root snapshot: the image by digest (``image_id``, from
        ``resolve_image``) and everything that builds the root (files, mounts, setup,
        limits, workdir), so a later group of the same task, or another task of the same
        image and setup, reuses the root; a new image digest or setup builds a new one."""
        parts = {"image": image_id, "files": self.files, "mounts": list(self.mounts), "workdir": self.workdir,
                 "setup": [s.model_dump(mode="json") for s in self.setup], "memory": self.memory, "pids": self.pids}
        if self.desktop is not None:  # only then: the keys of tasks without one stay as they were
            parts["desktop"] = self.desktop
        if net := self.network_kwargs():  # the same
            parts["network"] = net
        return "root-" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]

    def initial_messages(self) -> list[dict[str, Any]]:
        """The chat a trajectory starts from: the system text (if any) and the prompt."""
        msgs: list[dict[str, Any]] = []
        if self.system:
            msgs.append({"role": "system", "content": self.system})
        msgs.append({"role": "user", "content": self.prompt})
        return msgs


def resolve_image(task: TaskSpec, config: Config) -> str:
    """The digest that names ``task.image``: an image's id (pulled first if the store lacks
    it and the reference names its registry); 'host' or a folder as it is."""
    from ..runtime.container import images  # noqa: PLC0415 (the runtime only when a root is built)
    from ..runtime.state.store import Store  # noqa: PLC0415

    if images.names_folder(task.image):
        return task.image
    with Store.open(config.db_path) as store:
        base = images.resolve(config, store, task.image)
    return base.image_id or task.image


def parse_task(data: Any, *, source: str = "task spec") -> TaskSpec:
    """A :class:`TaskSpec` from already-parsed data; errors name the field."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source}: expected a mapping, got {type(data).__name__}",
                              hint="a task is an object with at least `id`")
    try:
        return TaskSpec.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top level)"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise InvalidArgument(
            f"{source}: field '{field}': {first['msg']}{more}",
            hint="see `bunshin rollout --help` or bunshin/rollout/task.py for the task format",
            field=field,
        ) from None


def load_task(path: str | Path) -> TaskSpec:
    """Read a task from a ``.yaml``/``.yml`` or ``.json`` file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise InvalidArgument(f"cannot read task file {p}: {e.strerror}", hint="give a YAML or JSON file") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise InvalidArgument(f"task file {p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
    return parse_task(data, source=f"task file {p}")


def parse_reward(stdout: str) -> float:
    """The last number on the last non-empty line of ``stdout``; raises ValueError if none."""
    for line in reversed(stdout.strip().splitlines()):
        found = _NUMBER.findall(line)
        if found:
            value = float(found[-1])
            if math.isnan(value):
                raise ValueError("reward is NaN")
            return value
        if line.strip():
            break
    raise ValueError(f"no number in reward output {stdout.strip()[-200:]!r}")
