"""Keeping one request's failure from taking down the others: which errors no request explains, and how
a failed step is cut into one part per request to find the request that fails alone."""
import contextlib
import logging

import torch

from pagedmoe.engine.kv_cache_manager import BlockTransfers
from pagedmoe.engine.scheduler import SchedulerOutput
from pagedmoe.engine.sequence import Request

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A step failed in a way no single request explains: the engine cannot go on."""


def is_fatal(error: BaseException) -> bool:
    """Out of memory, interrupts and exits say nothing about the request that happened to be running, nor
    does an error that marks itself fatal (a rank of a multi-process engine died)."""
    fatal = (MemoryError, torch.OutOfMemoryError)
    return not isinstance(error, Exception) or isinstance(error, fatal) or getattr(error, "is_fatal", False)


def is_bad_input(error: BaseException) -> bool:
    """An error that marks itself as caused by the request's own parameters (a server answers 400)."""
    return getattr(error, "is_bad_input", False)


def split_by_request(sched: SchedulerOutput) -> list[tuple[Request, SchedulerOutput]]:
    """One SchedulerOutput per request, in schedule order, without block transfers (the step applied them)."""
    parts: dict[str, tuple[Request, SchedulerOutput]] = {}
    for seq, num_new in zip(sched.seqs, sched.num_new_tokens):
        request, part = parts.setdefault(seq.request.request_id,
                                         (seq.request, SchedulerOutput([], [], BlockTransfers())))
        part.seqs.append(seq)
        part.num_new_tokens.append(num_new)
    return list(parts.values())


@contextlib.contextmanager
def failures_into(failed: dict[str, tuple[Request, Exception]], request: Request):
    """Records a non-fatal error raised for `request` in `failed` instead of raising it."""
    try:
        yield
    except Exception as error:
        if is_fatal(error):
            raise
        failed[request.request_id] = (request, error)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
