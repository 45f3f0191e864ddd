"""Checks on matplotlib figures shared by the tests: every drawn text inside the canvas."""

from __future__ import annotations


def texts_outside_canvas(fig, slack: float = 1.0) -> list[str]:
    """The texts drawn (titles, labels, tick labels in view, legend entries) whose window extent
    leaves the figure's canvas; [] when everything is inside."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    ticks = set()
    shown = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks.update((tick.label1, tick.label2))
                if low - 1e-9 <= tick.get_loc() <= high + 1e-9 and ax.get_visible():
                    shown += [t for t in (tick.label1, tick.label2) if t.get_visible()]
    shown += [t for t in fig.findobj(Text) if t not in ticks and t.get_visible()
              and (t.axes is None or t.axes.get_visible())]
    outside = []
    for text in shown:
        if not text.get_text().strip():
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < -slack or box.y0 < -slack or box.x1 > width + slack or box.y1 > height + slack:
            outside.append(f"{text.get_text()!r} at {box.bounds}")
    tight = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)
    if tight.x0 < -slack or tight.y0 < -slack or tight.x1 > width + slack or tight.y1 > height + slack:
        outside.append(f"the drawn artists' box {tight.bounds}")
    return outside


def _rotated_box(text, renderer):
    """The corners of ``text``'s drawn rectangle in display pixels: its window extent is the
    axis-aligned box around the rotated rectangle, whose centre it shares; the rectangle's own
    width and height are those of the text drawn unrotated."""
    import numpy as np

    box = text.get_window_extent(renderer)
    angle = text.get_rotation()
    text.set_rotation(0)
    flat = text.get_window_extent(renderer)
    text.set_rotation(angle)
    theta = np.deg2rad(angle)
    along, across = np.array([np.cos(theta), np.sin(theta)]), np.array([-np.sin(theta), np.cos(theta)])
    centre = np.array([(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2])
    half_w, half_h = flat.width / 2, flat.height / 2
    return [centre + sx * half_w * along + sy * half_h * across for sx, sy in ((-1, -1), (1, -1), (1, 1), (-1, 1))]


def _rectangles_overlap(a, b, slack: float) -> bool:
    """Separating-axis test of two convex quadrilaterals (corner lists): they overlap by more than
    ``slack`` pixels along every edge normal of either."""
    import numpy as np

    for quad in (a, b):
        for i in range(4):
            edge = quad[(i + 1) % 4] - quad[i]
            normal = np.array([-edge[1], edge[0]]) / (np.hypot(*edge) or 1.0)
            pa, pb = [normal @ p for p in a], [normal @ p for p in b]
            if min(max(pa), max(pb)) - max(min(pa), min(pb)) <= slack:
                return False
    return True


def overlapping_texts(texts, fig, slack: float = 0.5) -> list[tuple[str, str]]:
    """The pairs of ``texts`` (visible, non-empty) whose drawn rectangles overlap, rotation taken
    into account (a rotated label's window extent is far larger than the label)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    shown = [t for t in texts if t.get_visible() and t.get_text().strip()]
    boxes = [_rotated_box(t, renderer) for t in shown]
    return [(shown[i].get_text(), shown[j].get_text()) for i in range(len(shown)) for j in range(i + 1, len(shown))
            if _rectangles_overlap(boxes[i], boxes[j], slack)]


def legend_overlaps_axes(fig, legend, ax) -> bool:
    """Whether ``legend``'s drawn box overlaps ``ax``'s data area (the axes' patch)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return legend.get_window_extent(renderer).overlaps(ax.patch.get_window_extent(renderer))
