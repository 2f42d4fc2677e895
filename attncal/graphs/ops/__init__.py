"""The calibration ops themselves: their contract (`contract`: domain, types, inputs, attributes), the standard-ONNX
function body any runtime runs (`function_body`), one-node models holding an op (`single_op`), and the symbolic
shapes that let ONNX Runtime run an op in place (`inplace_shapes`).

The runtime imports the contract and the shapes from here without onnx_ir: nothing in this package loads it
at import time.
"""
