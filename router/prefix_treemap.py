"""The debug page's picture of prefix sharing: one treemap per engine, side by side.

Each engine's column is filled in proportion to the blocks its cache holds (the fullest engine's
column is full); inside it, every top cached prefix it holds is a rectangle whose area is that
prefix's blocks there (its branches included: a system prompt that many conversations continue is
large). A prefix has the same colour in every column, so a prefix cached on several engines (a
replica, or a split conversation) shows up as the same colour in several columns; the grey rest is
what the engine holds beyond the top prefixes. Drawn as inline SVG on the server: no script, so a
headless browser, a screenshot or a page saved to disk shows the same.
"""

from __future__ import annotations

import html
from typing import Any

WIDTH = 1100
COLUMN_HEIGHT = 240
COLUMN_GAP = 16
HEADER = 34


def colour(rank: int) -> str:
    """A distinct, readable colour for the prefix of this rank (golden-angle hues)."""
    return f"hsl({(rank * 137.508) % 360:.0f}, 62%, 58%)"


def squarify(sizes: list[float], x: float, y: float, width: float, height: float) -> list[tuple]:
    """Rectangles (x, y, w, h) for `sizes` (descending, summing to width * height), each as close to
    a square as the row it is laid in allows (Bruls, Huizing and van Wijk's squarified treemap)."""
    rects: list[tuple[float, float, float, float]] = []
    remaining = [size for size in sizes if size > 0]
    while remaining:
        short = min(width, height)
        if short <= 0:
            break
        row = [remaining[0]]
        index = 1
        while index < len(remaining) and _worst([*row, remaining[index]], short) <= _worst(row, short):
            row.append(remaining[index])
            index += 1
        remaining = remaining[index:]
        total = sum(row)
        if width >= height:  # a column along the left side
            column_width = total / height
            top = y
            for size in row:
                rects.append((x, top, column_width, size / column_width))
                top += size / column_width
            x, width = x + column_width, width - column_width
        else:  # a row along the top
            row_height = total / width
            left = x
            for size in row:
                rects.append((left, y, size / row_height, row_height))
                left += size / row_height
            y, height = y + row_height, height - row_height
    return rects


def _worst(row: list[float], short: float) -> float:
    total = sum(row)
    return max(
        max(short * short * size / (total * total), total * total / (short * short * size)) for size in row
    )


def sharing_svg(prefixes: list[dict[str, Any]], backends: dict[str, dict[str, Any]], redacted: bool) -> str:
    """The SVG for the page, from its data: `prefixes` (ranked, with `blocks` per backend) and the
    backends (with their index `blocks` per tier)."""
    names = list(backends)
    if not names:
        return '<p class="muted">no backends</p>'
    held: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
    for rank, prefix in enumerate(prefixes):
        for name, blocks in prefix.get("blocks", {}).items():
            if name in held and blocks > 0:
                held[name].append((rank, blocks))
    totals = {}
    for name in names:
        shown = sum(blocks for _, blocks in held[name])
        tiers = backends[name].get("blocks") or {}
        totals[name] = max(shown, max(tiers.values(), default=0))
    fullest = max(totals.values(), default=0)
    column_width = (WIDTH - COLUMN_GAP * (len(names) - 1)) / len(names)
    parts = [
        f'<svg id="sharing-map" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{HEADER + COLUMN_HEIGHT}" viewBox="0 0 {WIDTH} {HEADER + COLUMN_HEIGHT}" role="img" '
        'aria-label="cached prefixes per engine">'
    ]
    for column, name in enumerate(names):
        left = column * (column_width + COLUMN_GAP)
        total = totals[name]
        parts.append(
            f'<text x="{left:.1f}" y="14" class="map-engine">{html.escape(name)}</text>'
            f'<text x="{left:.1f}" y="28" class="map-note">{total:,} blocks</text>'
            f'<rect x="{left:.1f}" y="{HEADER}" width="{column_width:.1f}" height="{COLUMN_HEIGHT}" '
            'class="map-frame"/>'
        )
        if total <= 0 or fullest <= 0:
            parts.append(f'<text x="{left + 8:.1f}" y="{HEADER + 20}" class="map-note">nothing cached</text>')
            continue
        filled = COLUMN_HEIGHT * total / fullest
        top = HEADER + COLUMN_HEIGHT - filled
        area = column_width * filled
        items = sorted(held[name], key=lambda item: -item[1])
        rest = total - sum(blocks for _, blocks in items)
        sizes = [blocks * area / total for _, blocks in items] + ([rest * area / total] if rest > 0 else [])
        rects = squarify(sizes, left, top, column_width, filled)
        for position, (x, y, w, h) in enumerate(rects):
            if position < len(items):
                rank, blocks = items[position]
                prefix = prefixes[rank]
                engines = sum(1 for count in prefix.get("blocks", {}).values() if count > 0)
                tip = f"#{rank + 1}: {blocks:,} blocks here, {prefix['tokens']:,} tokens at most"
                if engines > 1:
                    tip += f", cached on {engines} engines"
                if not redacted and prefix.get("text"):
                    tip += "\n" + prefix["text"][:200]
                fill, label, css = colour(rank), f"#{rank + 1}", "map-cell"
                if engines > 1:
                    label += f" on {engines}"
            else:
                tip, fill, label, css = f"{rest:,} blocks of other prefixes", "#d5d9e2", "", "map-rest"
            parts.append(
                f'<g class="{css}"><title>{html.escape(tip)}</title>'
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w - 1, 0.5):.1f}" height="{max(h - 1, 0.5):.1f}" '
                f'fill="{fill}"/>'
            )
            if label and w > 34 and h > 16:
                parts.append(f'<text x="{x + 4:.1f}" y="{y + 13:.1f}" class="map-label">{label}</text>')
            parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def sharing_legend(prefixes: list[dict[str, Any]], redacted: bool, shown: int = 12) -> str:
    """The colour key under the map: rank, colour, engines holding it and its first words."""
    rows = []
    for rank, prefix in enumerate(prefixes[:shown]):
        engines = sorted(name for name, count in prefix.get("blocks", {}).items() if count > 0)
        if redacted or not prefix.get("text"):
            words = f"{prefix['tokens']:,} tokens"
        else:
            text = " ".join(prefix["text"].split())
            words = html.escape(text[:90] + ("…" if len(text) > 90 else ""))
        rows.append(
            f'<li><span class="swatch" style="background:{colour(rank)}"></span><b>#{rank + 1}</b> '
            f'<span class="muted">{html.escape(", ".join(engines))}</span> {words}</li>'
        )
    return f'<ul class="map-key">{"".join(rows)}</ul>' if rows else ""
