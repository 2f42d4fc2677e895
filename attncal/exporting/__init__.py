"""torch -> ONNX export: the plan (`plan`: every refusal, before anything is written), then its steps
(`exporter.export`, the pipeline; `from_torch`, `optimized_graphs`, `quantize`, ...).

`attncal.export` is the function `attncal.exporting.exporter.export`; this package holds the exporter's modules.
"""
