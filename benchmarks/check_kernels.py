"""GPU check of the Triton paged-attention kernel against the reference path (fresh random
inputs, bf16 and fp32), then its time against the reference at decode/verify shapes.

    PYTHONPATH=. python benchmarks/check_kernels.py
"""

import torch

from mtplx.engine.attention import AttentionMetadata, paged_attention_reference as paged_attention
from mtplx.kernels.paged_attention import paged_attention_triton


def case(rows, q_len, heads, kvh, d, page, ctx, key_start, dtype, device="cuda"):
    nblocks = rows * (-(-ctx // page)) + 4
    kp = torch.randn(nblocks + 1, page, kvh, d, device=device, dtype=dtype)
    vp = torch.randn(nblocks + 1, page, kvh, d, device=device, dtype=dtype)
    q = torch.randn(rows, q_len, heads, d, device=device, dtype=dtype)
    perm = torch.randperm(nblocks).tolist()
    tables, positions = [], []
    for r in range(rows):
        L = ctx - 7 * r
        nb = -(-L // page)
        tables.append(perm[:nb]); perm = perm[nb:]
        positions.append(list(range(L - q_len, L)))
    w = max(map(len, tables))
    tables = torch.tensor([t + [nblocks] * (w - len(t)) for t in tables], device=device)
    positions = torch.tensor(positions, device=device)
    meta = AttentionMetadata(positions, positions, tables, key_start)
    return q, kp, vp, meta


def main():
    torch.manual_seed(0)
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for args in [(1, 1, 32, 8, 128, 16, 300, 0), (4, 4, 32, 8, 128, 16, 1000, 0), (8, 2, 9, 3, 64, 16, 77, 1),
                     (3, 3, 16, 8, 128, 16, 4096, 0), (1, 4, 16, 16, 64, 16, 33, 1)]:
            q, kp, vp, meta = case(*args, dtype=dtype)
            scale = args[4] ** -0.5
            ref = paged_attention(q.double(), kp.double(), vp.double(), meta, scale)
            out = torch.full_like(q, float("nan"))
            out = paged_attention_triton(q, kp, vp, meta.positions, meta.block_tables, meta.key_start, scale)
            err = float((out.double() - ref).norm() / ref.norm())
            worst = max(worst, err) if dtype == torch.bfloat16 else worst
            limit = 1e-2 if dtype == torch.bfloat16 else 2e-3
            status = "ok" if err < limit and not torch.isnan(out).any() else "FAIL"
            print(f"{str(dtype):15} {args} rel err {err:.2e} {status}")
            if status == "FAIL":
                raise SystemExit(1)
    import triton.testing
    for q_len in (1, 4):
        q, kp, vp, meta = case(1, q_len, 32, 8, 128, 16, 512, 0, torch.bfloat16)
        t_ref = triton.testing.do_bench(lambda: paged_attention(q, kp, vp, meta, 0.088), return_mode="median")
        t_tri = triton.testing.do_bench(lambda: paged_attention_triton(q, kp, vp, meta.positions, meta.block_tables, 0, 0.088), return_mode="median")
        print(f"q_len {q_len} ctx 512: reference {t_ref*1e3:.1f} us, triton {t_tri*1e3:.1f} us")


if __name__ == "__main__":
    main()
