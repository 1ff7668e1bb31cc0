"""``make demo``: describe how a small TP=4 model is sharded, with no GPU and no process group.

Later stages grow this into a conversion through the server; this stage shows the layout
core: every rank's boxes and who writes each distinct box.
"""

from __future__ import annotations

import argparse
import sys

from reshard_svc.layout import Layout

MODEL = {
    "embed.weight": ((1000, 64), "tp=4", "S(0)"),
    "layers.0.attn.qkv.weight": ((192, 64), "tp=4", "SS(0,3)"),
    "layers.0.attn.o.weight": ((64, 64), "tp=4", "S(1)"),
    "layers.0.mlp.up.weight": ((170, 64), "dp=2,tp=2", "S(0),S(0)"),
    "layers.0.norm.weight": ((64,), "tp=4", "R"),
}


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    out = sys.stdout
    for name, (shape, mesh, placements) in MODEL.items():
        layout = Layout.parse(mesh, placements)
        out.write(f"{name}  shape={shape}  layout={layout}\n")
        for rank, boxes in enumerate(layout.shards(shape)):
            text = "  ".join(f"{b.offsets}+{b.sizes}" for b in boxes)
            out.write(f"    rank {rank}: {text}\n")
        writers = ", ".join(
            f"{it.box.offsets}->r{it.writer}" for it in layout.write_items(shape, 2)
        )
        out.write(f"    writers: {writers}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
