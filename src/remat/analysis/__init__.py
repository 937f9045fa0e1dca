"""Analysis and output: explaining timelines, the paper's and Megatron's formulas beside them, and the reports
(text, JSON, plots, HTML, memory snapshots)."""
