"""A DCP checkpoint (model + optimizer) written at world size 2 resumes at 1 and at 4.

Written by FSDP2 x EP2 after one AdamW step; resumed, each layout takes step 2 and must reach the
weights of an uninterrupted single-process run (fp32, atol 2e-5). At world size 4 the HF-layout
publish path is checked too: rank 0 gets every tensor, the other ranks none.
"""

from __future__ import annotations

import dist_workers as W
import torch

from asyncrl.distributed import load_dcp


def test_checkpoint_from_two_ranks_resumes_at_one_and_four(tmp_path):
    path = str(tmp_path / "ckpt")
    W.launch(W.worker_dcp_save, 2, path)

    model = W.make_model(seed=99)  # different init: everything must come from the checkpoint
    opt = W.make_optimizer(model)
    load_dcp(path, model, opt)
    opt.zero_grad()
    W.reference_step(model, W.make_rows()[: W.RESUME_ROWS])
    opt.step()
    ref = dict(W.reference_two_steps().named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name].detach(), atol=W.ATOL, rtol=W.RTOL)

    W.launch(W.worker_dcp_resume, 4, path)


def test_gather_to_rank0_places_uneven_and_replicated_shards():
    W.launch(W.worker_gather_to_rank0, 2)
