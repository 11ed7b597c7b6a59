"""The residual stream's RMS entering each layer of a model: the table behind ``--route-drift``.

A route drift head (``bmoe.synth.big``) writes into the routing dims through a layer's RMS norm, so
its output is scaled by the residual stream's RMS at that depth to land at unit size;
``bmoe.synth.shapes.RESIDUAL_RMS`` holds what this script prints for a skewed synthetic model.

Runs one prompt through plain llama.cpp (the file mapped, no repacking) with an eval callback that
reads each layer's output ``l_out-<il>`` (the next layer's input), last row, and prints the RMS
entering layers 1 .. n-1. The table's first entry, layer 0's input, is the embedding row's RMS,
known by construction (``sqrt((E - r) / E)``: the zeroed routing dims).

    python bench/residual_rms.py MODEL.gguf
"""

from __future__ import annotations

import argparse
import ctypes

import llama_cpp as L
import numpy as np

from bmoe.io.ggml import GgmlTensor

PROMPT = b"It is the sea, and the long road home went over the hills to the old town."
_F32 = 0


def layer_outputs(path: str) -> dict[int, float]:
    """RMS of ``l_out-<il>``'s last row, per layer."""
    rms: dict[int, float] = {}

    @L.ggml_backend_sched_eval_callback
    def watch(t, ask, _user):  # noqa: ANN001 - a ctypes callback
        tensor = GgmlTensor.from_address(t)
        name = tensor.name.decode()
        if ask:
            return name.startswith("l_out-")
        if tensor.type == _F32 and tensor.data:
            rows, cols = tensor.ne[1], tensor.ne[0]
            a = np.ctypeslib.as_array((ctypes.c_float * (rows * cols)).from_address(tensor.data))
            rms[int(name.split("-")[1])] = float(np.sqrt(np.mean(a.reshape(rows, cols)[-1] ** 2)))
        return True

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False  # map the file, no repacking into anonymous memory
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise SystemExit(f"cannot load {path}")
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.cb_eval = 256, 64, watch
    ctx = L.llama_init_from_model(model, cp)
    tokens = (L.llama_token * 128)()
    n = L.llama_tokenize(L.llama_model_get_vocab(model), PROMPT, len(PROMPT), tokens, 128, True, False)
    if L.llama_decode(ctx, L.llama_batch_get_one(tokens, n)) != 0:
        raise SystemExit("decode failed")
    L.llama_free(ctx)
    L.llama_model_free(model)
    return rms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    args = ap.parse_args()
    outs = layer_outputs(args.model)
    print("entering layer il (il >= 1: l_out-(il-1)):")
    print(", ".join(f"{outs[i]:.2f}" for i in sorted(outs)[:-1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
