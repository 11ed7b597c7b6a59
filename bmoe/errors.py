"""Every failure bmoe reports, as one tree.

Adapters map foreign errors (OSError, llama.cpp return codes, gguf-py parse errors) to these
classes at their own edge, so a caller needs to catch only ``BmoeError``, and the CLI can turn any
of them into a one-line message and exit status 1.

    BmoeError
    +-- ModelFileError            the GGUF cannot be used as given (checked before llama.cpp sees it)
    |   +-- NotGGUFError          wrong magic, or too short to hold a header
    |   +-- GGUFVersionError      a GGUF version this pin does not read
    |   +-- TruncatedFileError    the header, index or tensor data run past the end of the file
    |   +-- MissingKeyError       a metadata key the architecture needs is absent
    |   +-- ExpertLayoutError     expert tensors absent, or with shapes that disagree
    |   +-- MissingShardError     a shard of a split set is absent, or the set is opened mid-way
    +-- UnsupportedArchitectureError   no recipe for the file's architecture
    +-- SeamError                 llama.cpp does not behave as the seam contract says
    |   +-- SeamMismatchError     the ctypes mirror of ggml_tensor disagrees with libggml
    |   +-- LlamaCallError        a llama.cpp call returned a failure code
    +-- TraceFormatError          a route trace that cannot be read (names the file and line)
    +-- ReadError                 an expert read failed or came back short
    |   +-- ReadCancelled         a read given up because its stage was cancelled
    +-- BudgetError               a memory budget that cannot be honoured
    +-- RegionError               expert memory could not be released or unmapped (madvise, munmap)
    +-- ConfigError               a RunConfig value out of range
    |   +-- OutputPathError       an output path that is an input, a folder, or not writable
    +-- SessionClosedError        a call on a session that was closed (no native call is made)
    +-- ComputeBusyError          a blocking open on an event loop whose session's decode waits on it
    +-- DecodeAbortedError        a decode was stopped; its tokens were not emitted
        +-- GenerationCancelled   the caller cancelled the generation
"""

from __future__ import annotations


class BmoeError(Exception):
    """Base of every error bmoe raises on purpose."""


class ModelFileError(BmoeError):
    """The model file cannot be used as given."""


class NotGGUFError(ModelFileError):
    pass


class GGUFVersionError(ModelFileError):
    pass


class TruncatedFileError(ModelFileError):
    pass


class MissingKeyError(ModelFileError):
    pass


class ExpertLayoutError(ModelFileError):
    pass


class MissingShardError(ModelFileError):
    pass


class UnsupportedArchitectureError(BmoeError):
    pass


class SeamError(BmoeError):
    """llama.cpp, as loaded, breaks an assumption the streaming path depends on."""


class SeamMismatchError(SeamError):
    pass


class LlamaCallError(SeamError):
    pass


class TraceFormatError(BmoeError):
    pass


class ReadError(BmoeError):
    pass


class ReadCancelled(ReadError):
    """A read given up because its stage was cancelled (by another stage's failure, or a cancel)."""


class BudgetError(BmoeError):
    pass


class RegionError(BmoeError):
    """A call on bmoe's reserved expert memory failed; carries the errno."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class ConfigError(BmoeError):
    pass


class OutputPathError(ConfigError):
    pass


class SessionClosedError(BmoeError):
    """The session was closed: its model and context are gone, so the call cannot be made."""


class ComputeBusyError(BmoeError):
    """A blocking wait for the compute thread, made on an event loop that a decode running there
    waits on: each would wait for the other for ever (``Session.open_async`` is the way)."""


class DecodeAbortedError(BmoeError):
    """The decode was aborted; the token it would have produced is discarded."""


class GenerationCancelled(DecodeAbortedError):
    pass


def as_bmoe_error(exc: BaseException, cls: type[BmoeError], what: str) -> BmoeError:
    """``exc`` itself if it is a bmoe error; else a ``cls`` that says ``what`` failed and keeps the
    foreign exception as its cause. The one mapping every adapter applies where foreign errors
    enter (the eval callback, the user-open filler, the ready stage), so the cause is never lost."""
    if isinstance(exc, BmoeError):
        return exc
    wrapped = cls(f"{what}: {exc!r}")
    wrapped.__cause__ = exc
    return wrapped


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The exception a caller should see from a task group: a bmoe error before anything else
    (a stage failure before the cancellations it caused)."""
    flat: list[BaseException] = []

    def walk(g: BaseExceptionGroup) -> None:
        for e in g.exceptions:
            walk(e) if isinstance(e, BaseExceptionGroup) else flat.append(e)

    walk(group)
    # A read cancelled because another stage failed is a consequence: the failure itself (a thread
    # that could not start, say) is what to show, bmoe's own error or not.
    causes = [e for e in flat if not isinstance(e, ReadCancelled)] or flat
    return next((e for e in causes if isinstance(e, BmoeError)), causes[0])
