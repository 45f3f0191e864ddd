"""Reports of a study's stored results: ``build_report`` (one study: HTML, Markdown, CSV) and
``build_comparison`` (several side by side). Rendered from the result folder alone; nothing here
imports torch or transformers."""

from probe.report.build import ReportFiles, build_comparison, build_report
from probe.report.results import StudyResult, load_result

__all__ = ["ReportFiles", "StudyResult", "build_comparison", "build_report", "load_result"]
