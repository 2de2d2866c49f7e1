"""Graph passes: an exported graph -> fewer, fused dispatches, with the numbers proven unchanged.

The pipeline (passes/pipeline.py, a literal list): RemoveDeadShapeOp, ReorderQKVProjections,
FuseQKV, FuseGateUp, FuseRMSNorm, FuseAttention, FuseRoPE. One pass per file; each is called on
an `onnx_ir.Model` and returns `(model, modified, stats)`. `fuselm optimize` runs the list,
`fuselm diff` walks it and checks every stage in onnxruntime.
"""
