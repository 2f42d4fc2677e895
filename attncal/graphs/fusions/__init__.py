"""The graph passes that prepare a written graph for ONNX Runtime without changing its values
(`attncal.graphs.pass_base.GraphPass`): the rotary fusion (`rotary_fusion`), the native graph's fusions into
ONNX Runtime's own ops (`native_fusions`), the rewrites that let ONNX Runtime fuse at load time
(`load_time_fusions`), the feed-forward blocks over chunks of rows (`feed_forward_chunks`), and the ordered
lists the exporter runs (`passes`).  The calibration ops' in-place shapes are a pass of the ops'
(`attncal.graphs.ops.inplace_shapes`).
"""
