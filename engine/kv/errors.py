"""Typed errors of the block manager. Every error leaves the manager's state unchanged."""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every block-manager error."""


class OutOfPagesError(KVCacheError):
    """An allocation needs more pages than ``num_free + num_inactive``. Nothing was allocated.

    The scheduler should have asked ``can_allocate`` first; seeing this means admission lied or
    was skipped. Preempt a request (``release``) and retry, or shrink the step.
    """


class KVUsageError(KVCacheError):
    """The caller misused the API: unknown or already-released request, double create,
    rolling back committed tokens, committing slots that were never appended, ..."""


class PageRefOverflowError(KVCacheError):
    """A step's page references (counted once per table that lists a page) exceed the decode
    page-index buffer, ``max_page_refs(max_batch, max_model_len, page_size)``. A step error for
    that step: drop or shrink the batch; never a crash of the worker."""
