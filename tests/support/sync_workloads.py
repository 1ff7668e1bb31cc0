"""Worker functions for the weight sync session tests (``reshard_svc.WeightSync``): the
small Llama-shaped model of ``transfer_workloads`` pushed every "step" from a trainer mesh
into inference ranks, with sparse changes, restarts, failures and re-layouts in between.

The truth is a set of full tensors every rank evolves the same way (seeded by step and
name); trainer ranks copy their shard of it in place (an optimizer step), and every
receiver is compared, as integers (NaNs change), with its region of the truth.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.support import transfer_workloads as tw

DENSITIES = (0.0001, 0.01, 0.3, 1.0)
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ints(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT[t.element_size()])


class Truth:
    """The model's full tensors, changed the same way on every rank."""

    def __init__(self) -> None:
        self.full = {n: tw.full(n) for n in tw.trainer_params()}

    def step(self, step: int, density: float) -> None:
        for name, t in self.full.items():
            g = torch.Generator().manual_seed(step * 1009 + sum(map(ord, name)))
            where = torch.rand(t.shape, generator=g) < density
            fresh = torch.randint(-(2**15), 2**15, t.shape, generator=g, dtype=torch.int32)
            fresh = fresh.to(INT[t.element_size()]).view(t.dtype)  # any bits: NaNs included
            flat = fresh.view(-1)
            if flat.numel() >= 3:  # a -0.0, a denormal and a NaN among the new values
                flat[0], flat[1], flat[2] = -0.0, 1e-40, float("nan")
            ints(t).view(t.shape)[where] = ints(fresh).view(t.shape)[where]

    def expected(self, target: str) -> torch.Tensor:
        cat = tw.fused_names().get(target)
        if cat is None:
            return self.full[target]
        return torch.cat([self.full[s] for s in cat.sources], dim=cat.dim)


def _sources(mesh: Any, placements: Any, truth: Truth, only: Any = None) -> dict[str, Any] | None:
    if not tw._in(mesh):
        return None
    return {
        n: tw._dtensor(mesh, placements(n), t.clone())
        for n, t in truth.full.items()
        if only is None or only(n)
    }


def _refresh(src: dict[str, Any] | None, truth: Truth, placements: Any) -> None:
    """The trainer's step: each source's local shard becomes its shard of the truth, in
    place (torch's own distribute_tensor cuts it)."""
    for name, dt in (src or {}).items():
        want = tw._dtensor(dt.device_mesh, placements(name), truth.full[name])
        dt.to_local().copy_(want.to_local())


def engine_wrong(engine: dict[str, Any] | None, truth: Truth) -> list[str]:
    """LocalShard targets whose real region differs (as integers) or whose padding is not 0."""
    bad = []
    for name, shard in (engine or {}).items():
        data = shard.data
        region = tuple(slice(o, o + n) for o, n in zip(shard.offsets, data.shape))
        ok = torch.equal(ints(data), ints(truth.full[name][region])) if data.numel() else True
        ok = ok and all(bool((slab == 0).all()) for slab in shard.padding())
        if not ok:
            bad.append(name)
    return bad


def dtensors_wrong(dst: dict[str, Any] | None, truth: Truth, placements: Any) -> list[str]:
    bad = []
    for name, dt in (dst or {}).items():
        want = tw._dtensor(dt.device_mesh, placements(name), truth.expected(name)).to_local()
        if not torch.equal(ints(dt.to_local()), ints(want)):
            bad.append(name)
    return bad


def _result(res: Any) -> dict[str, Any]:
    return {
        "version": res.version,
        "sent": res.bytes_sent,
        "full": res.bytes_full,
        "received": res.bytes_received,
        "deltas": res.delta_pieces,
        "wholes": res.whole_pieces,
        "held": res.held_until_commit,
        "cached": res.plan_cached,
    }


def rl_loop() -> dict[str, Any]:
    """FSDP2 x TP trainer (ranks 0-3, a 2 x 2 mesh) -> a vLLM-like TP 4 engine of
    LocalShards (ranks 4-7): 20 pushes through begin/update/commit with sparse to dense
    changes; a restarted engine rank, a target overwritten behind the session's back, an
    aborted push, versions that go backwards or differ, and a trainer re-layout."""
    from reshard_svc import (
        DistributedError,
        TransferAbortedError,
        TransferError,
        UsageError,
        WeightSync,
    )
    from reshard_svc.sessions.sync.codec import Codec

    rank = dist.get_rank()
    trainer = tw._mesh([0, 1, 2, 3], (2, 2))
    truth = Truth()
    src = _sources(trainer, tw.fsdp_tp_placements, truth)
    engine = tw.engine_shards(rank - 4) if rank >= 4 else None
    sync = WeightSync(src, engine)
    out: dict[str, Any] = {"pushes": [], "wrong": [], "before_commit_wrong": []}
    for step in range(1, 21):
        density = DENSITIES[(step - 1) % 4]
        if step > 1:
            truth.step(step, density)
            _refresh(src, truth, tw.fsdp_tp_placements)
        if step == 7 and rank == 6:  # this engine restarted: zeros, a new session
            engine = tw.engine_shards(2)
            for shard in engine.values():
                shard.tensor.zero_()
            sync = WeightSync(src, engine)
        if step == 9 and rank == 5 and engine is not None:  # someone reloads rank 5's weights
            for shard in engine.values():
                shard.data.zero_()
        if step == 12:  # rank 7 fails while landing: nobody moves from version 11
            real = Codec.decode
            if rank == 7:

                def decode(self: Any, *a: Any) -> None:
                    raise RuntimeError("injected failure while landing")

                Codec.decode = decode  # type: ignore[method-assign]
            try:
                sync.push(step)
                out["aborted"] = None
            except TransferAbortedError as e:
                out["aborted"] = {"message": str(e), "updated": list(e.updated)}
            finally:
                Codec.decode = real  # type: ignore[method-assign]
            prev = Truth()
            for s in range(2, step):
                prev.step(s, DENSITIES[(s - 1) % 4])
            out["abort_kept_previous"] = engine_wrong(engine, prev) == []
            out["version_after_abort"] = sync.version
            continue
        sync.begin(step)
        sync.update()
        if engine is not None and step > 1:
            out["before_commit_wrong"].append(len(engine_wrong(engine, truth)))
        res = sync.commit()
        out["pushes"].append({"step": step, "density": density, **_result(res)})
        out["wrong"].append(engine_wrong(engine, truth))
    out["snapshot_bytes"] = sync.snapshot_bytes
    out["version"] = sync.version
    errors = {}
    cases = (
        ("backwards", 5),
        ("same", 20),
        ("differs", 21 + (rank == 3)),
        ("negative_on_one_rank", -1 if rank == 3 else 21),
    )
    for case, version in cases:
        try:
            sync.push(version)
            errors[case] = None
        except (TransferError, UsageError, DistributedError) as e:
            errors[case] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    # the trainer re-wraps (FSDP over all four ranks): every rank re-plans, pushes whole
    truth.step(30, 0.01)
    src = _sources(tw._mesh([0, 1, 2, 3]), lambda n: ["S(0)"], truth)
    res = sync.push(30, src=src)
    out["relayout"] = {**_result(res), "wrong": engine_wrong(engine, truth)}
    truth.step(31, 0.01)
    _refresh(src, truth, lambda n: ["S(0)"])
    res = sync.push(31)
    out["after_relayout"] = {**_result(res), "wrong": engine_wrong(engine, truth)}
    return out


def overlapping_fused_pp() -> dict[str, Any]:
    """Two more sessions: FSDP on ranks 0-5 into fused TP DTensors on ranks 4-7 (ranks 4
    and 5 in both; verify=True, several waves), and a 2-stage pipeline trainer into the
    LocalShard engine."""
    from reshard_svc import WeightSync

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    truth = Truth()
    src = _sources(tw._mesh([0, 1, 2, 3, 4, 5]), lambda n: ["S(0)"], truth)
    dst = tw._targets(tw._mesh([4, 5, 6, 7]))
    sync = WeightSync(src, dst, names=tw.fused_names(), verify=True, max_memory=4096)
    pushes = []
    for step, density in enumerate((None, 0.01, 0.3, 0.0001, 1.0), start=1):
        if density is not None:
            truth.step(step, density)
            _refresh(src, truth, lambda n: ["S(0)"])
        res = sync.push(step)
        pushes.append(
            {
                **_result(res),
                "waves": res.waves,
                "wrong": dtensors_wrong(dst, truth, tw.tp_placements),
            }
        )
    out["overlapping"] = pushes
    # a delta that patches wrong on rank 6 is refused by verify before anything is written
    from reshard_svc import TransferAbortedError
    from reshard_svc.runtime import delta

    truth.step(6, 0.01)
    _refresh(src, truth, lambda n: ["S(0)"])
    real = delta.patch
    if rank == 6:

        def patch(region: Any, where: Any, values: Any) -> None:
            real(region, where, values)
            ints(region).view(-1)[0] ^= 1 if region.is_contiguous() else 0

        delta.patch = patch  # type: ignore[assignment]
    try:
        sync.push(6)
        out["bad_patch"] = None
    except TransferAbortedError as e:
        out["bad_patch"] = str(e)
    finally:
        delta.patch = real  # type: ignore[assignment]
    out["bad_patch_kept"] = sync.version
    res = sync.push(7)
    out["after_bad_patch"] = {**_result(res), "wrong": dtensors_wrong(dst, truth, tw.tp_placements)}
    truth = Truth()
    src = _pp_sources(truth)
    engine = tw.engine_shards(rank - 4) if rank >= 4 else None
    # several waves into an engine whose fused buffers are shared by tensors of different
    # waves: writing one moves the others' write counters, which is not a foreign write
    sync = WeightSync(src, engine, max_memory=1024)
    pushes = []
    for step in range(1, 4):
        if step > 1:
            truth.step(step, 0.01)
            _refresh(src, truth, tw.tp_placements)
        res = sync.push(step)
        pushes.append({**_result(res), "waves": res.waves, "wrong": engine_wrong(engine, truth)})
    out["pipeline"] = pushes
    return out


def _pp_sources(truth: Truth) -> dict[str, Any] | None:
    rank = dist.get_rank()
    meshes = [tw._mesh([0, 1]), tw._mesh([2, 3])]
    if rank >= 4:
        return None
    stage = rank // 2
    return {
        n: tw._dtensor(meshes[stage], tw.tp_placements(n), t.clone())
        for n, t in truth.full.items()
        if tw.stage_of(n) == stage
    }


def _kept(full: dict[str, torch.Tensor]) -> Truth:
    t = Truth.__new__(Truth)
    t.full = {n: v.clone() for n, v in full.items()}
    return t


def _inject(victim: bool, wave: int, where: str) -> Any:
    """Make this rank fail (if ``victim``) in wave ``wave`` of the next push: at its
    boundary (after the wave is written) or inside it (receiving, or sending, its first
    piece). Returns the undo of the injection."""
    from reshard_svc.sessions.sync.codec import Codec
    from reshard_svc.sessions.sync.landing import Landing

    real = {
        k: getattr(cls, k)
        for cls, k in ((Landing, "wave_done"), (Codec, "decode"), (Codec, "encode"))
    }
    if not victim:
        return lambda: None

    def index(self: Any, w: Any) -> int:
        return int(self.geometry.wave_index[id(w)])

    def wave_of(self: Any, piece: Any) -> int:
        return int(self.geometry.wave_of_target[piece.target])

    if where == "boundary":

        def wave_done(self: Any, w: Any) -> None:
            real["wave_done"](self, w)
            if index(self, w) == wave:
                raise RuntimeError(f"injected failure after wave {wave}")

        Landing.wave_done = wave_done  # type: ignore[method-assign]
    else:

        def decode(self: Any, piece: Any, *a: Any) -> None:
            if wave_of(self, piece) == wave:
                raise RuntimeError(f"injected failure receiving in wave {wave}")
            real["decode"](self, piece, *a)

        def encode(self: Any, piece: Any, *a: Any) -> Any:
            if wave_of(self, piece) == wave:
                raise RuntimeError(f"injected failure sending in wave {wave}")
            return real["encode"](self, piece, *a)

        Codec.decode = decode  # type: ignore[method-assign]
        Codec.encode = encode  # type: ignore[method-assign]

    def restore() -> None:
        Landing.wave_done = real["wave_done"]  # type: ignore[method-assign]
        Codec.decode = real["decode"]  # type: ignore[method-assign]
        Codec.encode = real["encode"]  # type: ignore[method-assign]

    return restore


def _rows(truth: Truth, step: int, share: float) -> None:
    """A PULSE-like update: whole rows of a few matrices change, the rest stays."""
    for name, t in truth.full.items():
        if t.dim() != 2 or sum(map(ord, name)) % 3:
            continue
        g = torch.Generator().manual_seed(step * 7919 + sum(map(ord, name)))
        rows = torch.rand(t.shape[0], generator=g) < share
        fresh = torch.randn(t.shape, generator=g).to(t.dtype)
        t[rows] = fresh[rows]


def atomic_waves() -> dict[str, Any]:
    """One version everywhere: an FSDP2 x TP trainer (ranks 0-3) pushes into the
    LocalShard engine (ranks 4-7: fused qkv and gate_up buffers, KV heads replicated on
    two ranks, a padded vocabulary) under a budget that makes several waves. A failure is
    injected on a receiver (rank 5) and on a sender (rank 1) at every wave boundary and
    inside every wave: every rank raises and every engine rank holds the last committed
    version bitwise. Then densities from 0 to 100 % and a PULSE-like one, a write failing
    on one rank inside commit() (one wave and several), and an undo budget too small
    (fenced, then refilled)."""
    from reshard_svc import EngineFencedError, TransferAbortedError, WeightSync
    from reshard_svc.sessions.sync.landing import Landing

    rank = dist.get_rank()
    trainer = tw._mesh([0, 1, 2, 3], (2, 2))
    truth = Truth()
    src = _sources(trainer, tw.fsdp_tp_placements, truth)
    engine = tw.engine_shards(rank - 4) if rank >= 4 else None
    sync = WeightSync(src, engine, max_memory=1024)
    out: dict[str, Any] = {"failures": [], "mixed": 0, "densities": []}

    def advance(step: int, density: float) -> None:
        truth.step(step, density)
        _refresh(src, truth, tw.fsdp_tp_placements)

    res = sync.push(1)
    out["waves"] = res.waves
    advance(2, 0.01)
    sync.push(2)
    kept, version = _kept(truth.full), 3
    advance(version, 0.01)
    for wave in range(res.waves):
        for victim in (5, 1):
            for where in ("boundary", "inside"):
                restore = _inject(rank == victim, wave, where)
                try:
                    sync.push(version)
                    raised = None
                except TransferAbortedError as e:
                    raised = type(e).__name__
                finally:
                    restore()
                if raised is None:  # the injection was not reached: a committed push
                    mixed = engine_wrong(engine, truth) != []
                    kept, version = _kept(truth.full), version + 1
                    advance(version, 0.01)
                else:
                    mixed = engine_wrong(engine, kept) != [] or sync.version != sync.committed
                out["mixed"] += int(mixed)
                out["failures"].append([wave, victim, where, raised, sync.version])
    # the records survived every failed push: the next push is a delta, bitwise
    res = sync.push(version)
    out["after_failures"] = {**_result(res), "wrong": engine_wrong(engine, truth)}
    for density in (0.0, 0.0001, 0.01, 0.1, 0.5, 1.0, "pulse"):
        version += 1
        if density == "pulse":
            _rows(truth, version, 0.05)
            _refresh(src, truth, tw.fsdp_tp_placements)
        else:
            advance(version, float(density))
        res = sync.push(version)
        out["densities"].append(
            {
                "density": density,
                **_result(res),
                "encodings": dict(res.encodings),
                "wrong": engine_wrong(engine, truth),
            }
        )
    # a write that fails on one rank inside commit(): no rank switches (several waves:
    # the agreement fails; one wave: the write fails after writing)
    one_wave = WeightSync(src, engine)
    for session, label in ((sync, "commit_waves"), (one_wave, "commit_one_wave")):
        version += 1
        if session is one_wave:
            session.push(version)  # whole: the engine already holds it
            version += 1
        kept = _kept(truth.full)
        advance(version, 0.01)
        real = Landing.write_parked
        if rank == 6:

            def write_parked(self: Any, real: Any = real) -> None:
                real(self)
                raise OSError("injected failure writing at commit")

            Landing.write_parked = write_parked  # type: ignore[method-assign]
        try:
            session.push(version)
            raised = None
        except TransferAbortedError as e:
            raised = type(e).__name__
        finally:
            Landing.write_parked = real  # type: ignore[method-assign]
        out[label] = {
            "raised": raised,
            "wrong": engine_wrong(engine, kept),
            "version": session.version,
            "held": session.holds_until_commit,
        }
        res = session.push(version)  # the same push again lands
        out[label]["again_wrong"] = engine_wrong(engine, truth)
    # an undo budget too small: a failure after a wave was written fences the engine
    small = WeightSync(src, engine, max_memory=1024, undo_memory=1)
    version += 1
    small.push(version)
    version += 1
    advance(version, 0.01)
    restore = _inject(rank == 5, 1, "boundary")
    try:
        small.push(version)
        raised = None
    except TransferAbortedError as e:
        raised = type(e).__name__
        out["fenced_message"] = str(e) if isinstance(e, EngineFencedError) else None
    finally:
        restore()
    out["fenced"] = {"raised": raised, "version": small.version}
    res = small.push(version + (raised is None))
    out["refilled"] = {
        **_result(res),
        "version": small.version,
        "wrong": engine_wrong(engine, truth),
    }
    return out


def gqa_relay() -> dict[str, Any]:
    """GQA: one KV head, replicated on all four engine ranks (TP 4: q and o split, k, v and
    the norm whole on every rank), fed by an FSDP trainer on ranks 0-3. The plan relays
    the replicated boxes: each trainer rank sends each of its bytes once (its push report
    says so), the engine ranks forward the stripes among themselves, deltas included."""
    from reshard_svc import LocalShard, WeightSync

    rank = dist.get_rank()
    shapes = {
        "q_proj.weight": (64, 64),
        "k_proj.weight": (16, 64),
        "v_proj.weight": (16, 64),
        "o_proj.weight": (64, 64),
        "norm.weight": (64,),
    }
    g = torch.Generator().manual_seed(5)
    full = {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, shape in shapes.items()}
    trainer = tw._mesh([0, 1, 2, 3])
    src = None
    if rank < 4:
        src = {n: tw._dtensor(trainer, ["S(0)"], t.clone()) for n, t in full.items()}
    engine = None
    if rank >= 4:
        e = rank - 4
        engine = {
            "q_proj.weight": LocalShard(
                torch.zeros(16, 64, dtype=torch.bfloat16), (64, 64), (16 * e, 0)
            ),
            "o_proj.weight": LocalShard(
                torch.zeros(64, 16, dtype=torch.bfloat16), (64, 64), (0, 16 * e)
            ),
            **{
                n: LocalShard(
                    torch.zeros(shapes[n], dtype=torch.bfloat16), shapes[n], (0,) * len(shapes[n])
                )
                for n in ("k_proj.weight", "v_proj.weight", "norm.weight")
            },
        }

    def wrong() -> list[str]:
        bad = []
        for n, shard in (engine or {}).items():
            region = tuple(slice(o, o + k) for o, k in zip(shard.offsets, shard.data.shape))
            if not torch.equal(ints(shard.data), ints(full[n][region])):
                bad.append(n)
        return bad

    def change(step: int, density: float) -> None:
        for n, t in full.items():
            gen = torch.Generator().manual_seed(step * 31 + len(n))
            where = torch.rand(t.shape, generator=gen) < density
            ints(t).view(t.shape)[where] ^= 1
            if src is not None:
                want = tw._dtensor(trainer, ["S(0)"], t)
                src[n].to_local().copy_(want.to_local())

    sync = WeightSync(src, engine)
    local = sum(t.to_local().numel() * 2 for t in (src or {}).values())
    pushes = []
    for step, density in ((1, 0.0), (2, 0.02), (3, 1.0)):
        if step > 1:
            change(step, density)
        res = sync.push(step)
        pushes.append({**_result(res), "encodings": dict(res.encodings), "wrong": wrong()})
    return {"pushes": pushes, "local_bytes": local}


def scenarios(names: list[str]) -> dict[str, Any]:
    runs = {
        "rl_loop": rl_loop,
        "overlapping_fused_pp": overlapping_fused_pp,
        "atomic_waves": atomic_waves,
        "gqa_relay": gqa_relay,
    }
    return {name: runs[name]() for name in names}


def _targets_of(mesh: Any, names: list[str]) -> dict[str, Any] | None:
    if not tw._in(mesh):
        return None
    params = tw.trainer_params()
    return {
        n: tw._dtensor(mesh, ["S(0)"], torch.full(params[n][0], tw.SENTINEL, dtype=params[n][1]))
        for n in names
    }


# ---------------------------------------------------------------- processes killed mid-push


def kill_sweep(rank: int, points: list[Any], ports: list[int], results: Any, start: int) -> None:
    """Four processes of their own, one group per kill point (a fresh process takes the
    killed one's place): an FSDP trainer on ranks 0-1 pushes into TP 2 DTensors on ranks
    2-3 with a budget of several waves; at push 3 the point's victim is SIGKILLed at a
    wave boundary or inside a wave. Each survivor reports whether its engine still holds
    version 2 bitwise; the next group's new session pushes whole pieces, checked too."""
    import os
    import signal
    from datetime import timedelta

    from reshard_svc import DistributedError, EngineFencedError, WeightSync

    os.environ["OMP_NUM_THREADS"] = "1"
    for i in range(start, len(points)):
        victim, wave, where = points[i]
        out: dict[str, Any] = {"rank": rank, "point": i}
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{ports[i]}",
                rank=rank,
                world_size=4,
                timeout=timedelta(seconds=120),  # a fresh process imports torch meanwhile
            )
            truth = Truth()
            src = _sources(tw._mesh([0, 1]), lambda n: ["S(0)"], truth, _not_norm)
            dst = _targets_of(tw._mesh([2, 3]), [n for n in tw.trainer_params() if _not_norm(n)])
            # a survivor that talks to no dead peer notices the death at this timeout
            group = dist.new_group(list(range(4)), timeout=timedelta(seconds=5))
            sync = WeightSync(src, dst, max_memory=2048, process_group=group)
            for step in (1, 2):
                if step > 1:
                    truth.step(step, 0.01)
                    _refresh(src, truth, lambda n: ["S(0)"])
                res = sync.push(step)
                if step == 1:  # a new session in a re-formed group: whole pieces, bitwise
                    out["first"] = {**_result(res), "waves": res.waves}
                    out["first"]["wrong"] = dtensors_wrong(dst, truth, lambda n: ["S(0)"])
            kept = _kept(truth.full)
            truth.step(3, 0.01)
            _refresh(src, truth, lambda n: ["S(0)"])
            if victim is None:
                sync.push(3)
                out["wrong"] = dtensors_wrong(dst, truth, lambda n: ["S(0)"])
                dist.barrier()
                results.put(out)
                break
            if rank == victim:
                _inject_kill(wave, where, lambda: os.kill(os.getpid(), signal.SIGKILL))
            try:
                sync.push(3)
                out["raised"] = None
            except DistributedError as e:
                out["raised"] = type(e).__name__
            out["fenced"] = isinstance(out.get("raised"), str) and out["raised"] == (
                EngineFencedError.__name__
            )
            out["version"] = sync.version
            out["kept"] = dtensors_wrong(dst, kept, lambda n: ["S(0)"]) == []
        except Exception as e:  # reported to the test, which fails on it
            out["error"] = f"{type(e).__name__}: {e}"
        results.put(out)
        if dist.is_initialized():
            dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)  # gloo may abort while the interpreter tears down (see harness)


def _not_norm(name: str) -> bool:
    return "norm" not in name


def _inject_kill(wave: int, where: str, die: Any) -> None:
    """This process dies in wave ``wave`` of the next push: after the wave is written
    (its boundary), or inside it (as it receives, or sends, its first piece)."""
    from reshard_svc.sessions.sync.codec import Codec
    from reshard_svc.sessions.sync.landing import Landing

    if where == "boundary":
        real_done = Landing.wave_done

        def wave_done(self: Any, w: Any) -> None:
            real_done(self, w)
            if self.geometry.wave_index[id(w)] == wave:
                die()

        Landing.wave_done = wave_done  # type: ignore[method-assign]
        return
    real_decode, real_encode = Codec.decode, Codec.encode

    def decode(self: Any, piece: Any, *a: Any) -> None:
        if self.geometry.wave_of_target[piece.target] == wave:
            die()
        real_decode(self, piece, *a)

    def encode(self: Any, piece: Any, *a: Any) -> Any:
        if self.geometry.wave_of_target[piece.target] == wave:
            die()
        return real_encode(self, piece, *a)

    Codec.decode = decode  # type: ignore[method-assign]
    Codec.encode = encode  # type: ignore[method-assign]
