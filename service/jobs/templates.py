"""One job's chat-template process: the bounded renderer every job that renders a chat template uses.

A chat template is a program from the model folder; a job renders it in a child process bounded by
ENGRAM_TEMPLATE_TIMEOUT_S / _MEMORY_BYTES / _MAX_CHARS (:mod:`service.engine.template_render`), and
a cancellation of the job kills the child while it renders, so the job stops in its own process
(not by the grace kill of the whole job process). Collection, evaluation, generation and
calibration start one per job.
"""

from __future__ import annotations

from collections.abc import Callable

from service.config import Settings
from service.engine.template_render import TemplateLimits, TemplateProcess
from service.jobs.ports import JobsContext


def template_limits(settings: Settings) -> TemplateLimits:
    return TemplateLimits(settings.template_max_chars, settings.template_memory_bytes, settings.template_timeout_s)


def cancel_requested(ctx: JobsContext, job_id: str) -> Callable[[], bool]:
    """Whether the job was asked to stop, read from its record (the renderer polls it only while a
    render is slower than its poll interval, so a normal render reads nothing)."""

    def asked() -> bool:
        job = ctx.jobs.get(job_id)
        return bool(job and job.cancel_requested)

    return asked


def template_process(ctx: JobsContext, job_id: str) -> TemplateProcess:
    """The job's renderer (a context manager: its child is killed when the job leaves it)."""
    return TemplateProcess(template_limits(ctx.settings), cancel_requested(ctx, job_id))
