"""What the front end (AsyncEngine) and the engine core say to each other. A message is a tuple
whose first item is its kind.

Front end -> core:
    ("add", AddRequest)                     one API request's children, all accepted or none
    ("abort", [request ids])
    ("call", call id, fn, args, kwargs)     fn(core, *args, **kwargs) between two steps
    ("drain", timeout)                      no more adds; finish or abort what runs, then stop
Core -> front end:
    ("tokenizer", tokenizer)                the model's, once it is read (engine/core_proc.py only) ...
    ("ready", CoreInfo)                     ... then the process is up, its CoreInfo without that tokenizer
    ("failed", message)                     ... or could not start
    ("added", request id, error or None, requests waiting)
    ("outputs", [EngineCoreOutput], requests waiting)      at most one a step
    ("result", call id, value, error)
    ("stopped",)  /  ("dead", error)        the last message

In a thread (engine/core_client.py's CoreThread) the tuples pass as they are. Between processes each is two
ZeroMQ frames: the kind, then the body, as msgpack (msgspec) for the messages of every request and
step, as pickle for the rare rest (functions, snapshots, errors; both ends are this package).
"""

from __future__ import annotations

import pickle
from typing import Optional

import msgspec

from pagedmlx.lora.request import LoRARequest
from pagedmlx.multimodal.inputs import MultiModalFeatureSpec
from pagedmlx.outputs import EngineCoreOutput
from pagedmlx.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, array_like=True):
    request_id: str  # the API request's id: the "added" reply names it
    children: list[tuple[str, list[int], SamplingParams]]  # (engine request id, prompt token ids, params)
    priority: int = 0
    cache_salt: Optional[str] = None
    arrival_time: float = 0.0  # time.monotonic() in the front end (a clock every process shares)
    lora_request: Optional[LoRARequest] = None  # the adapter every child runs with
    mm_features: Optional[list[list[MultiModalFeatureSpec]]] = None  # per child: its images (None: text only)


_MSGPACK_BODIES = {"add": tuple[AddRequest], "abort": tuple[list[str]],
                   "outputs": tuple[list[EngineCoreOutput], int], "drain": tuple[float]}
_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(body) for kind, body in _MSGPACK_BODIES.items()}


def encode(message: tuple) -> list[bytes]:
    kind, body = message[0], message[1:]
    if kind in _MSGPACK_BODIES:
        return [kind.encode(), _encoder.encode(body)]
    try:
        return [kind.encode(), pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)]
    except Exception:  # noqa: BLE001 - an error that does not pickle: send its words
        return [kind.encode(), pickle.dumps(tuple(_picklable(x) for x in body), protocol=pickle.HIGHEST_PROTOCOL)]


def decode(frames: list[bytes]) -> tuple:
    kind = frames[0].decode()
    decoder = _decoders.get(kind)
    return (kind, *(decoder.decode(frames[1]) if decoder is not None else pickle.loads(frames[1])))


def _picklable(value):
    if isinstance(value, BaseException):
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001
            return RuntimeError(f"{type(value).__name__}: {value}")
    return value
