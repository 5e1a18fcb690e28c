"""The SDK's protobuf bodies <-> grooves' datums and results.

The schema is the ``tinker`` package's own generated module (``tinker.proto.tinker_public_pb2``),
imported when first needed; nothing of it is copied here. Anything malformed raises
``UserError`` with what was wrong, so the route answers 400 and the service stays up.
"""

from __future__ import annotations

import numpy as np

from grooves.backend.queue import UserError
from grooves.training.datums import Datum, ForwardBackwardOutput, LossConfig

MAX_BODY_BYTES = 64 * 1024 * 1024

# loss_fn_inputs each Tinker loss reads (cross_entropy: weights optional, 1 everywhere without them)
LOSS_INPUTS = {
    "cross_entropy": {"target_tokens", "weights"},
    "importance_sampling": {"target_tokens", "logprobs", "advantages"},
    "ppo": {"target_tokens", "logprobs", "advantages"},
    "cispo": {"target_tokens", "logprobs", "advantages"},
}
_REQUIRED = {"cross_entropy": {"target_tokens"}, "importance_sampling": {"target_tokens", "logprobs", "advantages"},
             "ppo": {"target_tokens", "logprobs", "advantages"}, "cispo": {"target_tokens", "logprobs", "advantages"}}


def pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as exc:  # pragma: no cover - the [backend] extra is missing
        raise RuntimeError("grooves backend needs the tinker SDK: pip install 'grooves[backend]'") from exc
    return tinker_public_pb2


def parse_forward_backward(body: bytes):
    """``(model_id, seq_id, loss_fn, LossConfig, forward_only, [Datum])`` of a request body."""
    from google.protobuf.message import DecodeError

    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise UserError(f"the forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    if msg.loss_fn not in LOSS_INPUTS:
        raise UserError(f"loss_fn {msg.loss_fn!r} is not supported; supported: {', '.join(LOSS_INPUTS)}")
    if not msg.data:
        raise UserError("forward_backward needs at least one datum")
    datums = [_datum(i, d, msg.loss_fn) for i, d in enumerate(msg.data)]
    return msg.model_id, msg.seq_id or None, msg.loss_fn, _loss_config(msg), msg.forward_only, datums


def _loss_config(msg) -> LossConfig:
    values = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"}
    values.update({k: v for k, v in msg.loss_fn_config.items() if k not in values})
    text = [k for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "text"]
    unknown = set(values) - {"clip_low_threshold", "clip_high_threshold"} | set(text)
    if unknown:
        raise UserError(f"loss_fn_config key(s) {sorted(unknown)} are not supported; supported: "
                        "clip_low_threshold, clip_high_threshold")
    low, high = values.get("clip_low_threshold"), values.get("clip_high_threshold")
    return LossConfig(eps_low=None if low is None else 1.0 - low, eps_high=None if high is None else high - 1.0)


def _datum(index: int, msg, loss_fn: str) -> Datum:
    tokens: list[int] = []
    for chunk in msg.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise UserError(f"datum {index}: only token chunks are supported, not {chunk.WhichOneof('chunk')}")
        tokens += _array(chunk.encoded_text.tokens, np.int32, f"datum {index} tokens").tolist()
    names = set(msg.loss_fn_inputs)
    if names - LOSS_INPUTS[loss_fn] or _REQUIRED[loss_fn] - names:
        raise UserError(f"datum {index}: {loss_fn} takes loss_fn_inputs {sorted(LOSS_INPUTS[loss_fn])} "
                        f"(required: {sorted(_REQUIRED[loss_fn])}); got {sorted(names)}")
    inputs = {name: _tensor(tensor, f"datum {index} {name}") for name, tensor in msg.loss_fn_inputs.items()}
    return Datum(tokens, [int(t) for t in inputs["target_tokens"]],
                 weights=_floats(inputs.get("weights")), logprobs=_floats(inputs.get("logprobs")),
                 advantages=_floats(inputs.get("advantages")))


def _floats(values):
    return None if values is None else [float(v) for v in values]


_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}


def _tensor(msg, what: str) -> np.ndarray:
    if msg.WhichOneof("encoding") != "dense":
        raise UserError(f"{what}: only dense tensors are supported")
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"{what}: unsupported dtype {msg.dtype}")
    values = _array(msg.dense, dtype, what)
    if list(msg.shape) not in ([], [len(values)]):
        raise UserError(f"{what}: only 1-D tensors are supported, got shape {list(msg.shape)}")
    if not np.all(np.isfinite(values)):
        raise UserError(f"{what}: contains NaN or infinity")
    return values


def _array(data: bytes, dtype, what: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise UserError(f"{what}: {len(data)} bytes is not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(data, dtype=dtype)


def forward_backward_output(out: ForwardBackwardOutput, datums: list[Datum], loss_fn: str) -> bytes:
    """A ``ForwardBackwardOutput`` protobuf: per datum ``logprobs`` (and ``elementwise_loss``), metrics."""
    msg = pb().ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for key, value in out.metrics().items():
        msg.metrics[key] = value
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(datums)
    logprobs = [np.concatenate([np.zeros(d.start, np.float32), lp.numpy().astype(np.float32)])
                for d, lp in zip(datums, out.logprobs)]
    _batched(record.fields["logprobs"], logprobs)
    if loss_fn == "cross_entropy":
        losses = [-lp * (np.ones_like(lp) if d.weights is None else np.asarray(d.weights, np.float32))
                  for d, lp in zip(datums, logprobs)]
        _batched(record.fields["elementwise_loss"], losses)
    return msg.SerializeToString()


def _batched(field, arrays: list[np.ndarray]) -> None:
    field.dtype = 1  # float32
    field.data = b"".join(a.astype(np.float32).tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.size * 4 for a in arrays], dtype=np.int64).tobytes()


def sample_response(completions, prompt_logprobs: list[float] | None) -> bytes:
    msg = pb().SampleResponse()
    for c in completions:
        seq = msg.sequences.add()
        seq.stop_reason = pb().STOP_REASON_LENGTH if c.finish_reason == "length" else pb().STOP_REASON_STOP
        seq.tokens = np.asarray(c.token_ids, np.int32).tobytes()
        seq.logprobs = np.asarray(c.logprobs, np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return msg.SerializeToString()
