"""Reports of a study's stored results: ``build_report`` (one study: HTML, Markdown, CSV) and
``build_comparison`` (several side by side). Rendered from the result folder alone; nothing here
imports torch or transformers."""
