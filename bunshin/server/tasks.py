"""A task that arrives over HTTP: the JSON form of ``TaskSpec``, held to what a remote caller may ask."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgument
from ..rollout.task import TaskSpec, parse_task
from .images import check_image


def http_task(data: dict[str, Any]) -> TaskSpec:
    """The checked task (its image 'host' or a reference: :mod:`.images`); a host folder as
    the image, or shared host folders, are refused
    (those are local choices of whoever runs ``bunshin rollout`` on the host)."""
    task = parse_task(data, source="task")
    check_image(task.image, "task: field 'image'")
    if task.mounts:
        raise InvalidArgument("task: field 'mounts': host folders are not shared over HTTP", field="mounts",
                              hint="put the files in the task's 'files' or its setup")
    return task
