"""A tensor's layout as a picture: the global tensor cut into its boxes, each coloured by
the mesh coordinates that hold it (replicas named), for any mesh dim count.

:func:`layout_picture` is the shared model: a grid of cells over two dims of the tensor
(dims 0 and 1; a 1-D tensor is one row; a scalar one cell), each cell the index of the box
covering it, and every box with its offsets, sizes, holders and their mesh coordinates.
``reshard inspect URI --layout TENSOR`` draws it in a terminal. Dims beyond the two drawn
are shown at index 0 (a box is drawn where it covers that slice), and said so.
"""

from __future__ import annotations

from typing import Any

from reshard_svc.errors import UsageError
from reshard_svc.format.index import TensorMeta
from reshard_svc.layout import Box

__all__ = ["layout_picture"]


def layout_picture(meta: TensorMeta, rows: int = 16, cols: int = 64) -> dict[str, Any]:
    """The picture of ``meta``'s stored layout, at most ``rows`` x ``cols`` cells."""
    if rows < 1 or cols < 1:
        raise UsageError("a layout picture needs at least one row and one column")
    shape = tuple(meta.shape)
    boxes: list[dict[str, Any]] = []
    if meta.layout is not None:
        mesh = meta.layout.mesh
        names = mesh.names or tuple(f"d{i}" for i in range(len(mesh.shape)))
        for item in meta.layout.write_items(shape, meta.itemsize):
            boxes.append(
                {
                    "box": item.box,
                    "holders": list(item.holders),
                    "coords": [dict(zip(names, mesh.coordinate(r))) for r in item.holders],
                }
            )
        mesh_json: dict[str, Any] | None = {"shape": list(mesh.shape), "names": list(names)}
    else:  # no layout recorded (HF, plain files): the stored chunks, by file
        mesh_json = None
        for c in meta.chunks:
            boxes.append({"box": c.box, "holders": [], "coords": [], "file": c.file})
    drawn = [d for d in (0, 1) if d < len(shape)]
    n_rows = min(rows, shape[0]) if len(shape) >= 2 else 1
    n_cols = min(cols, shape[-1] if len(shape) == 1 else shape[1]) if shape else 1
    n_rows, n_cols = max(1, n_rows), max(1, n_cols)

    def at(i: int, n: int, size: int) -> int:
        return min(size - 1, int((i + 0.5) * size / n)) if size else 0

    grid = []
    for i in range(n_rows):
        row = []
        for j in range(n_cols):
            point = [0] * len(shape)
            if len(shape) == 1:
                point[0] = at(j, n_cols, shape[0])
            elif len(shape) >= 2:
                point[0], point[1] = at(i, n_rows, shape[0]), at(j, n_cols, shape[1])
            row.append(next((k for k, b in enumerate(boxes) if _holds(b["box"], point)), -1))
        grid.append(row)
    return {
        "tensor": meta.name,
        "shape": list(shape),
        "dtype": str(meta.dtype).removeprefix("torch."),
        "layout": str(meta.layout) if meta.layout else None,
        "mesh": mesh_json,
        "dims_drawn": drawn,
        "grid": grid,
        "boxes": [
            {
                "offsets": list(b["box"].offsets),
                "sizes": list(b["box"].sizes),
                "holders": b["holders"],
                "coords": b["coords"],
                **({"file": b["file"]} if "file" in b else {}),
            }
            for b in boxes
        ],
        "note": _note(len(shape)),
    }


def _holds(box: Box, point: list[int]) -> bool:
    return all(o <= p < o + s for o, s, p in zip(box.offsets, box.sizes, point))


def _note(ndim: int) -> str:
    if ndim <= 2:
        return ""
    rest = list(range(2, ndim))
    if len(rest) == 1:
        return "dim 2 is shown at index 0"
    return f"dims {', '.join(map(str, rest))} are shown at index 0"
