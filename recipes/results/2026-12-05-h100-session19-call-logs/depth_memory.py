"""Session 19: why tests/test_parity_cuda.py::test_cuda_peak_memory_independent_of_depth fails on the GPU (peak
reserved 48 blocks - 12 blocks 1.547 GiB against the 1.125 GiB of 36 more saved block inputs; session 8: 1.125).
The test's two models (Llama width 1024, 4 x 2048, bf16-mixed, streaming placement, 3 steps), per variant: peak
allocated / reserved in the first step and in steps 2-3 apart. Variants: as the suite runs it (blocks compiled),
compile_blocks=False, and the first forward's check replaced by a plain call (engine/first_call.py)."""
import sys

import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, "tests")
import test_parity_cuda as t  # noqa: E402
from megatrain_lightning.engine import first_call  # noqa: E402


class StepPeaks(Callback):
    def on_train_start(self, trainer, pl_module):
        torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        self.peaks = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.synchronize()
        self.peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
        torch.cuda.reset_peak_memory_stats()


def run(variant, **options):
    gib = 2**30
    got = {}
    for layers in (12, 48):
        peaks = StepPeaks()
        r, _ = t._timed_fit(t._depth_factory(layers), t.pinned(**options), max_steps=3, precision="bf16-mixed",
                            callbacks=[peaks], **t.CUDA)
        got[layers] = peaks.peaks
        del r
        t._free_cuda()
    for i, step in enumerate(("step 1", "step 2", "step 3")):
        a12, r12 = got[12][i]; a48, r48 = got[48][i]
        print(f"{variant:28s} {step}: 12 blocks alloc {a12/gib:.3f} res {r12/gib:.3f}; 48 blocks alloc {a48/gib:.3f} "
              f"res {r48/gib:.3f}; diff alloc {(a48-a12)/gib:.3f} res {(r48-r12)/gib:.3f} (inputs 1.125)", flush=True)


run("default (compiled)")
run("compile_blocks=False", compile_blocks=False)
first_call.FirstCall.__call__ = lambda self, call: call(self.args, self.kwargs)
run("compiled, no first-call check")
run("eager, no first-call check", compile_blocks=False)
