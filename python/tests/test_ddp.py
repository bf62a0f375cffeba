"""Data-parallel training on PyTorch's own engine: DistributedDataParallel over gloo with two
local processes gives the gradients one process computes on the same global batch."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from test_modules import TinyModel, running_mean_task

STEPS, GLOBAL_BATCH, TOKENS = 3, 4, 12


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")


def train(model, x_all, y_all, grad_of):
    """STEPS of SGD; returns every step's gradients (after the all-reduce, for DDP)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    history = []
    for step in range(STEPS):
        x, y = x_all[step], y_all[step]
        opt.zero_grad()
        torch.nn.functional.mse_loss(grad_of(x), y).backward()
        history.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return history


def data():
    gen = torch.Generator().manual_seed(5)
    batches = [running_mean_task(GLOBAL_BATCH, TOKENS, 4, gen) for _ in range(STEPS)]
    return ([x.double() for x, _ in batches], [y.double() for _, y in batches])


def worker(rank, world, port, out_path):
    loopback_env(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyModel().double()
        ddp = DistributedDataParallel(model)
        xs, ys = data()
        per = GLOBAL_BATCH // world
        shard = slice(rank * per, (rank + 1) * per)
        history = train(model, [x[shard] for x in xs], [y[shard] for y in ys], ddp)
        if rank == 0:
            torch.save(history, out_path)
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_equal_single_process(tmp_path):
    out_path = str(tmp_path / "ddp_grads.pt")
    mp.spawn(worker, args=(2, free_port(), out_path), nprocs=2, join=True)
    ddp_history = torch.load(out_path)

    torch.manual_seed(0)
    model = TinyModel().double()
    xs, ys = data()
    single_history = train(model, xs, ys, model)

    worst = 0.0
    for step, (a_list, b_list) in enumerate(zip(ddp_history, single_history)):
        for a, b in zip(a_list, b_list):
            # DDP averages two half-batch gradients; one process sums the whole batch: the same
            # float64 quantities summed in another order, so they agree to rounding.
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), f"step {step}"
            worst = max(worst, (a - b).abs().max().item())
    print(f"DDP (2 processes, gloo) vs one process: max |grad diff| = {worst:.3e} "
          f"over {STEPS} steps")
