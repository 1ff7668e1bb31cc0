"""Module-level worker functions for the distributed tests (spawned processes import them)."""

from __future__ import annotations

import torch

# name -> (shape, dtype)
TENSORS = {
    "model.embed.weight": ((37, 16), torch.float32),
    "model.layers.0.qkv.weight": ((24, 16), torch.bfloat16),
    "model.layers.0.o.weight": ((16, 23), torch.float32),
    "model.layers.0.up.weight": ((41, 16), torch.bfloat16),
    "model.layers.0.norm.weight": ((16,), torch.float32),
    "model.tiny": ((3,), torch.float32),
    "optim.state.step": ((), torch.float32),
}


def full_tensor(name: str) -> torch.Tensor:
    """A deterministic global tensor per name (same on every rank)."""
    shape, dtype = TENSORS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def placements_for(name: str, mesh_ndim: int, variant: int) -> list[str]:
    """Some realistic and some awkward placements per tensor, varied by ``variant``."""
    if name == "optim.state.step":
        return ["R"] * mesh_ndim
    menu_1d = {
        0: {
            "qkv": "SS(0,3)",
            "o": "S(1)",
            "norm": "R",
            "embed": "S(0)",
            "up": "S(0)",
            "tiny": "S(0)",
        },
        1: {"qkv": "S(0)", "o": "S(0)", "norm": "S(0)", "embed": "S(1)", "up": "R", "tiny": "R"},
        2: {"qkv": "S(1)", "o": "R", "norm": "S(0)", "embed": "S(0)", "up": "S(1)", "tiny": "S(0)"},
    }
    menu_2d = {
        0: {
            "qkv": "SS(0,2),S(0)",
            "o": "S(0),S(1)",
            "norm": "S(0),R",
            "embed": "R,S(0)",
            "up": "S(1),S(0)",
            "tiny": "S(0),S(0)",
        },
        1: {
            "qkv": "R,SS(0,3)",
            "o": "S(1),R",
            "norm": "R,R",
            "embed": "S(0),S(1)",
            "up": "S(0),S(0)",
            "tiny": "R,S(0)",
        },
    }
    menu_2d[2] = {
        "qkv": "S(1),S(0)",
        "o": "R,S(1)",
        "norm": "R,R",
        "embed": "S(0),R",
        "up": "S(0),S(1)",
        "tiny": "S(0),R",
    }
    menu = menu_1d if mesh_ndim == 1 else menu_2d
    key = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    from reshard_svc.layout.placements import split_top_level

    return split_top_level(menu[variant][key])


def build_state_dict(mesh_shape: tuple[int, ...], variant: int, fill: bool = True) -> dict:
    """Nested state dict of DTensors on ``mesh_shape`` (plain tensor for the scalar)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from reshard_svc.layout import parse_placements
    from reshard_svc.runtime import _compat

    mesh = init_device_mesh("cpu", mesh_shape)
    sd: dict = {"model": {"layers": {"0": {}}}, "optim": {"state": {}}, "step": 0, "meta": {}}
    for name in TENSORS:
        g = full_tensor(name) if fill else torch.zeros_like(full_tensor(name))
        if name == "optim.state.step":
            sd["optim"]["state"]["step"] = g
            continue
        pls = _compat.to_torch_placements(
            parse_placements(placements_for(name, len(mesh_shape), variant))
        )
        try:
            dt = distribute_tensor(g, mesh, pls)
        except AssertionError:
            dt = distribute_tensor(g, mesh, pls, src_data_rank=None)
        parts = name.split(".")
        node = sd
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = dt
    if fill:
        sd["step"] = 42
        sd["meta"] = {"note": "hello", "lrs": [0.1, 0.01]}
    return sd


def leaf(sd: dict, name: str):
    node = sd
    for p in name.split("."):
        node = node[p]
    return node


def mismatches(sd: dict) -> list[str]:
    """Tensor names whose full value differs from the expected global tensor."""
    from reshard_svc.runtime import _compat

    bad = []
    for name in TENSORS:
        v = leaf(sd, name)
        full = v.full_tensor() if _compat.is_dtensor(v) else v
        want = full_tensor(name)
        if full.dtype != want.dtype or not torch.equal(full, want):
            bad.append(name)
    return bad


def save_then_load(path: str, save_mesh, load_meshes) -> list:
    """Save on ``save_mesh``; load into each of ``load_meshes`` (same world) and compare."""
    import reshard_svc

    sd = build_state_dict(tuple(save_mesh), 0)
    reshard_svc.save(sd, path)
    out = []
    for i, mesh in enumerate(load_meshes):
        target = build_state_dict(tuple(mesh), (i + 1) % 2, fill=False)
        stats = reshard_svc.load(target, path, max_memory=1024, strategy="exchange")
        out.append(
            {
                "bad": mismatches(target),
                "step": target["step"],
                "meta": target["meta"],
                "bytes_read": stats.bytes_read,
                "bytes_planned": stats.bytes_planned,
                "bytes_total": stats.bytes_total,
                "waves": stats.waves,
            }
        )
    return out


def load_only(path: str, mesh, strategy: str = "exchange") -> dict:
    import reshard_svc

    target = build_state_dict(tuple(mesh), 1, fill=False)
    stats = reshard_svc.load(target, path, strategy=strategy)
    return {
        "strategy": stats.strategy,
        "bad": mismatches(target),
        "bytes_read": stats.bytes_read,
        "bytes_planned": stats.bytes_planned,
        "bytes_total": stats.bytes_total,
    }


def tensors_only(sd: dict) -> dict:
    """The state dict without JSON extras (torch DCP wants tensors only here)."""
    out = {k: v for k, v in sd.items() if k in ("model", "optim")}
    return out


def torch_reads_ours(path: str, save_mesh, load_mesh) -> list[str]:
    """We save on ``save_mesh``; torch's HuggingFaceStorageReader loads into ``load_mesh``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    import reshard_svc

    reshard_svc.save(build_state_dict(tuple(save_mesh), 0), path)
    target = tensors_only(build_state_dict(tuple(load_mesh), 2, fill=False))
    dcp.load(target, storage_reader=HuggingFaceStorageReader(path))
    return mismatches(target)


def we_read_torch(path: str, save_mesh, load_mesh) -> list[str]:
    """torch's HuggingFaceStorageWriter(save_distributed=True) saves; our load reads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    import reshard_svc

    dcp.save(
        tensors_only(build_state_dict(tuple(save_mesh), 2)),
        storage_writer=HuggingFaceStorageWriter(path, save_distributed=True),
    )
    target = tensors_only(build_state_dict(tuple(load_mesh), 0, fill=False))
    reshard_svc.load(target, path)
    return mismatches(target)


def sharded_tensor_round_trip(path: str) -> dict:
    """Save a legacy ShardedTensor (ChunkShardingSpec, as FSDP1/torchrec make them); load it
    back into a DTensor with another layout and into another ShardedTensor."""
    import torch.distributed as dist
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import reshard_svc

    world = dist.get_world_size()
    g = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.empty(spec, 7, 5)
    for shard in st.local_shards():
        o, s = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(g[o[0] : o[0] + s[0], o[1] : o[1] + s[1]])
    reshard_svc.save({"emb": st}, path)
    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.zeros(7, 5), mesh, [Shard(1)])
    reshard_svc.load({"emb": dt}, path)
    spec1 = ChunkShardingSpec(dim=1, placements=[f"rank:{r}/cpu" for r in range(world)])
    st2 = sharded_tensor.zeros(spec1, 7, 5)
    reshard_svc.load({"emb": st2}, path)
    ok2 = all(
        torch.equal(
            sh.tensor,
            g[
                sh.metadata.shard_offsets[0] : sh.metadata.shard_offsets[0]
                + sh.metadata.shard_sizes[0],
                sh.metadata.shard_offsets[1] : sh.metadata.shard_offsets[1]
                + sh.metadata.shard_sizes[1],
            ],
        )
        for sh in st2.local_shards()
    )
    return {"dtensor_ok": bool(torch.equal(dt.full_tensor(), g)), "sharded_ok": ok2}


def convert_stage(src: str, dst: str, kwargs: dict) -> dict:
    """One conversion by every worker of the launched group."""
    import reshard_svc

    _map_libraries()
    _reset_peak()
    before = _rss_mb()
    res = reshard_svc.convert(src, dst, **kwargs)
    peak = _peak_mb()
    return {
        "strategy": res.strategy,
        "waves": res.waves,
        "bytes_read_total": res.bytes_read_total,
        "bytes_exchanged": res.bytes_exchanged,
        "rss_before_mb": before,
        "peak_rss_mb": peak,
    }


def _map_libraries() -> None:
    """Map every page of the files this process has mapped (torch's libraries, ...) into
    it now, so that the growth measured next is the conversion's memory. A worker forked
    from the preloaded forkserver shares those pages with it but has not mapped them yet:
    the code a conversion runs would otherwise count as its growth (tens of MB), where a
    spawned worker had mapped much of it while importing."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    populate_read = 22  # MADV_POPULATE_READ (Linux 5.14): page tables filled, read-only
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/") or "r" not in fields[1]:
                continue  # anonymous, [heap], [stack], [vdso], or unreadable
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            libc.madvise(lo, hi - lo, populate_read)  # an error leaves it as it was


def _reset_peak() -> None:
    """Reset this process's RSS high-water mark (VmHWM); ru_maxrss survives exec."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_mb() -> float:
    import os

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def load_direct(path: str, mesh) -> dict:
    import reshard_svc

    target = build_state_dict(tuple(mesh), 1, fill=False)
    stats = reshard_svc.load(target, path, strategy="direct")
    return {
        "bad": mismatches(target),
        "bytes_read": stats.bytes_read,
        "bytes_total": stats.bytes_total,
    }


def integrity_cases(cases: dict, tmp: str) -> dict:
    """Load (both strategies) and convert every corrupted copy; report what each raised.

    ``cases`` maps a case name to a checkpoint path holding ``w`` (rows x 1024 fp32) and
    ``b`` (1000 fp32). Every rank must raise for every case, with no hang.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import reshard_svc

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for case, path in sorted(cases.items()):
        rows = 1536  # the tests' w (inspect would refuse the truncated case up front)
        for strategy in ("exchange", "direct"):
            target = {
                "w": distribute_tensor(torch.zeros(rows, 1024), mesh, [Shard(0)]),
                "b": distribute_tensor(torch.zeros(1000), mesh, [Replicate()]),
            }
            try:
                reshard_svc.load(target, path, strategy=strategy)
                out[f"{case}/load-{strategy}"] = "ok"
            except Exception as e:
                out[f"{case}/load-{strategy}"] = f"{type(e).__name__}: {e}"
        try:
            reshard_svc.convert(path, f"{tmp}/out-{case}", mesh=f"tp={world}", rules={"w": "S(0)"})
            out[f"{case}/convert"] = "ok"
        except Exception as e:
            out[f"{case}/convert"] = f"{type(e).__name__}: {e}"
    return out


def replicated_fan_out(path: str) -> dict:
    """Five same-shaped tensors (one plan template, rotated per tensor) and one with rows
    wider than a holder's share, saved FSDP-sharded on a 4-rank mesh and loaded
    ``Replicate`` on a 2 x 2 mesh with ``exchange``: the copies go out through the
    holders (a second round per wave). Returns the mismatching names and whether any wave
    relayed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import reshard_svc
    from reshard_svc.plan import read as read_plan

    shapes = {f"w{i}": (61, 24) for i in range(5)} | {"wide": (6, 1000)}
    full = {}
    for name, shape in shapes.items():
        g = torch.Generator().manual_seed(sum(map(ord, name)))
        full[name] = torch.randn(shape, generator=g).to(torch.bfloat16)
    flat = init_device_mesh("cpu", (4,))
    reshard_svc.save({n: distribute_tensor(t, flat, [Shard(0)]) for n, t in full.items()}, path)
    mesh = init_device_mesh("cpu", (2, 2))
    target = {
        n: distribute_tensor(torch.zeros_like(t), mesh, [Replicate(), Replicate()])
        for n, t in full.items()
    }
    read_plan.PLANS.clear()
    reshard_svc.load(target, path, max_memory=4096, strategy="exchange")
    relayed = any(w.relays for p in read_plan.PLANS.values() for w in p.waves)
    bad = [
        n
        for n, t in target.items()
        if not torch.equal(t.to_local().view(torch.int16), full[n].view(torch.int16))
    ]
    return {"bad": bad, "relayed": relayed}


def saves_in_flight(root: str, saves: int, in_flight: int, fork: bool) -> list[list[str]]:
    """``saves`` async saves queued back to back through one ``AsyncSaver(max_in_flight=)``
    (each a different state: the step is added to every tensor), none waited for until
    the last; then each loaded back. Returns, per save, the tensors that do not match."""
    import os

    import reshard_svc
    from reshard_svc.runtime import _compat
    from reshard_svc.runtime.async_save import AsyncSaver

    os.environ["RESHARD_ASYNC_FORK"] = "1" if fork else "0"
    saver = AsyncSaver(max_in_flight=in_flight)
    futures = []
    for step in range(saves):
        sd = build_state_dict((2,), 0)
        for name in TENSORS:
            leaf(sd, name).add_(step)  # in place: a DTensor stays a DTensor
        futures.append(saver.save(sd, f"{root}/step-{step}"))
    for f in futures:
        f.result()
    saver.close()
    bad = []
    for step in range(saves):
        target = build_state_dict((2,), 1, fill=False)
        reshard_svc.load(target, f"{root}/step-{step}")
        wrong = []
        for name in TENSORS:
            v = leaf(target, name)
            full = v.full_tensor() if _compat.is_dtensor(v) else v
            if not torch.equal(full, full_tensor(name) + step):
                wrong.append(name)
        bad.append(wrong)
    return bad
