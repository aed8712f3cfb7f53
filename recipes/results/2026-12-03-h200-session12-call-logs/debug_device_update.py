"""Debug (session 12): test_auto_placement_cuda (b) 32-true diverged after an out-of-memory back-off with
update_on_device=2. Re-run that scenario with every device update logged (norms of host and device state)."""
import sys
sys.path.insert(0, "tests")
import torch
from megatrain_lightning.engine import device_update as du
import test_auto_placement_cuda as t

orig_update, orig_run_block = du.DeviceUpdate._update, du.DeviceUpdate.run_block
def _update(self, store, master, holder, grads, then, priority, own_master=False):
    n = store.train_numel
    ea, eas = store.moment_buffers()
    torch.cuda.synchronize()
    pre = dict(key=getattr(holder, "block", "resident"), n=n, fresh=holder.moments_fresh, own=own_master,
               host_master=float(store.master[:n].norm()), host_ea=float(ea.norm()), host_eas=float(eas.norm()),
               dev_master=float(master.norm()) if holder.moments_fresh or not own_master else None,
               grads=float(sum(g.double().norm()**2 for g in grads if g is not None) ** 0.5),
               pinned=(store.master.is_pinned(), ea.is_pinned(), eas.is_pinned()))
    fut = orig_update(self, store, master, holder, grads, then, priority, own_master)
    torch.cuda.synchronize()
    post = dict(dev_master=float(master.norm()), m=float(holder.moments[0].norm()), v=float(holder.moments[1].norm()),
                host_master_after=float(store.master[:n].norm()), host_ea_after=float(ea.norm()))
    print("DEVICE UPDATE", pre, post, flush=True)
    return fut
du.DeviceUpdate._update = _update

precision = sys.argv[1] if len(sys.argv) > 1 else "32-true"
factory = lambda: t.PlainQwen(layers=12, batch=8, seq=2048, steps=4)
cuda = dict(t.CUDA, precision=precision)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
try:
    t._backs_off_and_runs_again(factory, cuda)
    print("SAME TRAINING: ok")
except AssertionError as e:
    print("SAME TRAINING: FAILED", str(e)[:600])
