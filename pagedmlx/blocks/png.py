"""The pool picture as a PNG (Pillow, the optional `png` extra): a title, a summary line, one
square per block coloured by state, and a legend."""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from pagedmlx.blocks.snapshot import CACHED, FREE, IN_USE, SHARED, STATE_NAMES
from pagedmlx.blocks.view import cell_states

COLORS = {FREE: (208, 208, 208), CACHED: (30, 144, 255), IN_USE: (0, 190, 0), SHARED: (255, 140, 0)}
BACKGROUND, INK, GREY = (255, 255, 255), (20, 20, 20), (110, 110, 110)


def save_png(snap: dict, path: str, cols: int = 64, cell: int = 12, gap: int = 2, max_rows: int = 64) -> None:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as exc:  # the optional extra
        raise RuntimeError("--png needs Pillow: pip install 'pagedmlx[png]' (or pip install pillow)") from exc
    states = snap["block_states"]
    per_cell = max(1, -(-len(states) // (cols * max_rows)))
    cells = cell_states(states, per_cell)
    rows = -(-len(cells) // cols)
    font, small = ImageFont.load_default(size=16), ImageFont.load_default(size=12)
    label_w, margin, pitch = 52, 16, cell + gap
    top = margin + 52
    width = margin * 2 + label_w + cols * pitch
    height = top + rows * pitch + 56
    img = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(img)

    p, s = snap["pool"], snap["scheduler"]
    when = datetime.fromtimestamp(snap["time"]).strftime("%Y-%m-%d %H:%M:%S")
    title = f"pagedmlx KV pool{' ' + snap['model'] if snap.get('model') else ''}  ({when})"
    draw.text((margin, margin), title, fill=INK, font=font)
    hit = snap["prefix_cache"]["hit_rate"]
    draw.text((margin, margin + 24), f"{p['num_blocks']} blocks x {p['block_size']} tokens, {p['usage']:.1%} in use; "
              f"{s['running']} running, {s['waiting']} waiting; prefix-cache hit rate {hit:.1%}; "
              f"{s['preemptions']} preemptions", fill=GREY, font=small)
    for i, state in enumerate(cells):
        r, c = divmod(i, cols)
        if c == 0:
            label = str(i * per_cell)
            draw.text((margin + label_w - 8 - draw.textlength(label, font=small), top + r * pitch - 1), label,
                      fill=GREY, font=small)
        x, y = margin + label_w + c * pitch, top + r * pitch
        draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=COLORS[state])

    counts = Counter(states)
    x, y = margin + label_w, top + rows * pitch + 16
    for state in (FREE, CACHED, IN_USE, SHARED):
        draw.rectangle((x, y + 2, x + cell - 1, y + cell + 1), fill=COLORS[state])
        label = f"{STATE_NAMES[state]} {counts[state]}"
        draw.text((x + cell + 6, y), label, fill=INK, font=small)
        x += cell + 6 + int(draw.textlength(label, font=small)) + 24
    if per_cell > 1:
        draw.text((margin + label_w, y + 20), f"1 square = {per_cell} blocks (the state most of them are in)",
                  fill=GREY, font=small)
    img.save(path, "PNG")
