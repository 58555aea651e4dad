"""SWE-ReX's remote-runtime wire shapes (pydantic), as ``swerex.runtime.abstract`` defines them.

The bunshin server answers them under ``/swerex/{workspace_id}`` (``bunshin.server.swerex``)
so that ``swerex.runtime.remote.RemoteRuntime`` (and SWE-agent through it) runs unchanged
against a workspace. Field names, defaults and the discriminators are SWE-ReX's; unknown
fields are ignored, as SWE-ReX's own models do. Errors travel as SWE-ReX's do: status 511
and ``{"swerexception": {message, class_path, traceback, extra_info}}``, which its client
raises again as the class at ``class_path``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


class IsAliveResponse(BaseModel):
    is_alive: bool
    message: str = ""


class CreateBashSessionRequest(BaseModel):
    startup_source: list[str] = []
    session: str = "default"
    session_type: Literal["bash"] = "bash"
    startup_timeout: float = 1.0


class CreateBashSessionResponse(BaseModel):
    output: str = ""
    session_type: Literal["bash"] = "bash"


class BashAction(BaseModel):
    command: str
    session: str = "default"
    timeout: float | None = None
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: Literal["silent", "raise", "ignore"] = "raise"
    error_msg: str = ""
    expect: list[str] = []
    action_type: Literal["bash"] = "bash"


class BashInterruptAction(BaseModel):
    session: str = "default"
    timeout: float = 0.2
    n_retry: int = 3
    expect: list[str] = []
    action_type: Literal["bash_interrupt"] = "bash_interrupt"


Action = Annotated[BashAction | BashInterruptAction, Field(discriminator="action_type")]


class BashObservation(BaseModel):
    output: str = ""
    exit_code: int | None = None
    failure_reason: str = ""
    expect_string: str = ""
    session_type: Literal["bash"] = "bash"


class CloseBashSessionRequest(BaseModel):
    session: str = "default"
    session_type: Literal["bash"] = "bash"


class CloseBashSessionResponse(BaseModel):
    session_type: Literal["bash"] = "bash"


class Command(BaseModel):
    command: str | list[str]
    timeout: float | None = None
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: dict[str, str] | None = None
    cwd: str | None = None
    merge_output_streams: bool = False


class CommandResponse(BaseModel):
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None


class ReadFileRequest(BaseModel):
    path: str
    encoding: str | None = None
    errors: str | None = None


class ReadFileResponse(BaseModel):
    content: str = ""


class WriteFileRequest(BaseModel):
    content: str
    path: str


class Empty(BaseModel):
    """``WriteFileResponse``, ``UploadResponse``, ``CloseResponse``: no fields."""


class ExceptionTransfer(BaseModel):
    """SWE-ReX's ``_ExceptionTransfer``: what its client raises again."""

    message: str = ""
    class_path: str = ""
    traceback: str = ""
    extra_info: dict[str, Any] = {}
