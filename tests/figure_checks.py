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
