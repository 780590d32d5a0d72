# ../shared/baselines/torchrun_recovery.py with a timeline of each start: where the time after a restart goes.
# Two ranks train a small linear layer; rank 1 dies at step 20 of the first attempt; rank 0 prints, for
# each attempt, the seconds spent importing torch, in init_process_group, creating the CUDA context and
# model, and in the first step. Under either launcher:
#   torchrun --standalone --nproc_per_node 2 --max-restarts 1 --monitor-interval 0.1 recovery_timeline.py nccl
#   ltrain run --nproc-per-node 2 --device cuda --max-restarts 1 -- python3 recovery_timeline.py nccl
import time; T0 = time.time()
import os, sys, torch, torch.distributed as dist
T1 = time.time()
backend = sys.argv[1] if len(sys.argv) > 1 else "gloo"
dist.init_process_group(backend); r = dist.get_rank(); rc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
T2 = time.time()
dev = "cuda" if backend == "nccl" else "cpu"
if dev == "cuda": torch.cuda.set_device(r)
torch.manual_seed(0); m = torch.nn.Linear(256, 256).to(dev); opt = torch.optim.SGD(m.parameters(), lr=0.01)
if dev == "cuda": torch.cuda.synchronize()
T3 = time.time()
for step in range(40):
    loss = m(torch.randn(32, 256, device=dev)).pow(2).mean(); opt.zero_grad(); loss.backward()
    if step == 0: T4 = time.time()
    for p in m.parameters(): dist.all_reduce(p.grad)
    opt.step()
    if step == 0 and r == 0:
        T5 = time.time()
        print(f"TIMELINE restart={rc} start={T0:.3f} import={T1-T0:.2f} init_pg={T2-T1:.2f} cuda+model={T3-T2:.2f} "
              f"fwd_bwd={T4-T3:.2f} first_allreduce+step={T5-T4:.2f} total={T5-T0:.2f}", flush=True)
    if dev == "cuda": torch.cuda.synchronize()
    if rc == 0 and step == 20 and r == 1: print(f"CRASH t={time.time():.3f}", flush=True); os._exit(1)
    time.sleep(0.02)
