"""Line charts as standalone SVG: a few series of (x, y) points, solid or dashed (a bound drawn
beside the figure it bounds), axes with round ticks, a legend. No plotting library: the file is
a few kilobytes of text that any browser or image viewer opens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from xml.sax.saxutils import escape

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 760, 440, 70, 190, 40, 55


@dataclass(frozen=True)
class Series:
    label: str
    points: list[tuple[float, float]]
    colour: int = 0  # index into COLOURS: a bound shares its figure's colour
    dashed: bool = False


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values covering lo..hi (steps of 1, 2 or 5 times a power of ten)."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    out, v = [], first
    while v <= hi + step * 1e-9:
        out.append(round(v, 12))
        v += step
    return out


def _label(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.2e}"


def line_chart(series: list[Series], title: str, x_label: str, y_label: str) -> str:
    """The SVG document of `series` (at least one point among them)."""
    pts = [p for s in series for p in s.points]
    if not pts:
        raise ValueError("nothing to draw: no points")
    xs, ys = ticks(min(x for x, _ in pts), max(x for x, _ in pts)), ticks(0.0, max(y for _, y in pts))
    x0, x1, y1 = xs[0], xs[-1], ys[-1]
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1.0) * w

    def py(y: float) -> float:
        return TOP + h - y / (y1 or 1.0) * h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2:.0f}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for x in xs:
        out.append(f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{TOP + h}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{px(x):.1f}" y="{TOP + h + 18}" text-anchor="middle">{_label(x)}</text>')
    for y in ys:
        out.append(f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{LEFT + w}" y2="{py(y):.1f}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{LEFT - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{_label(y)}</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" fill="none" stroke="#444"/>')
    out.append(f'<text x="{LEFT + w / 2:.0f}" y="{HEIGHT - 12}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text transform="translate(18 {TOP + h / 2:.0f}) rotate(-90)" text-anchor="middle">'
               f'{escape(y_label)}</text>')
    for n, s in enumerate(series):
        colour = COLOURS[s.colour % len(COLOURS)]
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(s.points))
        out.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        if not s.dashed:
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in s.points]
        ly = TOP + 12 + 18 * n
        out.append(f'<line x1="{LEFT + w + 14}" y1="{ly}" x2="{LEFT + w + 40}" y2="{ly}" stroke="{colour}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{LEFT + w + 46}" y="{ly + 4}">{escape(s.label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
