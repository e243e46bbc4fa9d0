"""Wire types of the request plane, shared by the frontend and the workers."""

from headwater.wire.messages import (
    Ack,
    Cancel,
    Chunk,
    End,
    Error,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    KvHandle,
    Reply,
    Role,
    SamplingParams,
    StructuredKind,
    StructuredOutput,
    TokenLogprobs,
    WorkerLoad,
)

__all__ = [
    "Ack",
    "Cancel",
    "Chunk",
    "End",
    "Error",
    "ErrorCode",
    "FinishReason",
    "GenerateRequest",
    "KvHandle",
    "Reply",
    "Role",
    "SamplingParams",
    "StructuredKind",
    "StructuredOutput",
    "TokenLogprobs",
    "WorkerLoad",
]
