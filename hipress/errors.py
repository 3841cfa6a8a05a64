"""Exception hierarchy of HiPress.

Every error HiPress raises on purpose derives from :class:`HiPressError`, so callers can
catch ours apart from bugs. Subclasses also derive from the matching built-in (a bad
payload is a :class:`ValueError`), so generic handlers keep working.
"""


class HiPressError(Exception):
    """Base class of every error HiPress raises on purpose."""


class ConfigError(HiPressError, ValueError):
    """A configuration value or file is invalid; the message names the key and the fix."""


class CodecError(HiPressError, ValueError):
    """A codec was asked for something it cannot do (bad parameter, unsupported dtype)."""


class PayloadError(HiPressError, ValueError):
    """A payload is truncated, corrupted, or belongs to another codec, dtype or version."""


class NonFiniteGradientError(HiPressError, ValueError):
    """A gradient holds NaN or Inf and the codec's policy is to refuse it.

    Lossy codecs compute a scale or a threshold from the gradient; with NaN/Inf inside it
    every decoded element would be garbage, so they raise this error naming the gradient
    instead. Casting codecs (identity, fp16, bf16) propagate NaN/Inf faithfully.
    """


class SyncError(HiPressError, RuntimeError):
    """Synchronization failed: a stalled gradient, a dead rank, a peer that failed.

    Submissions whose arguments disagree across ranks raise
    :class:`CollectiveArgumentError` instead, and the engine goes on.
    """


class PeerFailure(SyncError):
    """Another rank failed, or finished while this one still waited for its gradients.

    Raised on the ranks that are affected, not on the one that caused it; the message
    names that rank, whose own output shows the cause.
    """


class StallError(SyncError):
    """A gradient was submitted on some ranks but not on others for longer than the timeout."""


class CollectiveArgumentError(HiPressError, ValueError):
    """A collective's arguments are invalid on some rank or disagree across ranks.

    Raised by the collective's handle on every rank, in the same negotiation round and
    before any data moves (alltoall splits that do not add up, allgather tensors whose
    trailing dimensions differ, allreduces of another shape, dtype, op or compression,
    broadcast tensors of another shape or dtype, grouped allreduces of another size, an
    integer average refused on one rank); the message names the ranks and the values.
    The engine keeps running: later collectives are unaffected.
    """
