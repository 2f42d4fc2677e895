"""The PyTorch calibration on CUDA: split placement (torch SDPA's CUDA kernels, never the [B,H,S,S]
probabilities) against eager calibration (`implementation="efficient"` on the eager probabilities), float32,
on the synthetic long model (XLM-R, 4 layers, hidden 256, 4 heads), mean pooling (every row calibrated), one
item padded so that the key-padding path runs.  The timing at 8 x 8192 is benchmarks/gpu_check.py's."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_split_placement_on_cuda_matches_eager_calibration(cuda_torch):
    torch = cuda_torch
    from transformers import AutoModel

    from attncal.calibration import CalibrationConfig, calibrate
    from attncal.synthetic import make_config

    torch.manual_seed(0)
    batch, seq = 2, 1024
    cfg = make_config("xlm-roberta", layers=4, hidden=256, heads=4, intermediate=1024, max_positions=2 * seq)
    eager = AutoModel.from_config(cfg, attn_implementation="eager").eval().cuda()
    sdpa = AutoModel.from_config(cfg, attn_implementation="sdpa").eval().cuda()
    sdpa.load_state_dict(eager.state_dict())
    ids = torch.randint(10, 100, (batch, seq), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, seq - 300:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    cal = CalibrationConfig(pooling="mean", variant="uniform")
    with torch.no_grad():
        with calibrate(eager, cal, implementation="efficient"):
            ref = eager(**inputs).last_hidden_state
        with calibrate(sdpa, cal, implementation="split") as patch:
            assert patch.implementation == "split"
            got = sdpa(**inputs).last_hidden_state
        plain = sdpa(**inputs).last_hidden_state
    valid = mask.bool()[..., None]
    err = float(torch.where(valid, got - ref, 0.0).abs().max())
    # float32 both ways (cuBLAS without TF32, SDPA's memory-efficient kernel), summed in other orders over
    # 1024 keys and 4 layers: far below what the calibration changes (the last assertion).
    assert err <= 1e-4, err
    assert float(torch.where(valid, plain - got, 0.0).abs().max()) > 1e-3  # the calibration did something
