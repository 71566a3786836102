"""The decoder's maths, each idea written once, from which every path assembles the model: the
eager forward (models/llama.py) and the compiled steps (compiled/lone_step.py, compiled/flat_step.py),
which differ from it only in how they read K/V and lay out weights.

shape.py      the sizes and constants, read once from the transformers config
rms_norm.py   RMSNorm
rotary.py     the rotary table and the rotation
activation.py the MLP's SiLU-gated product
attention.py  softmax over keys in parts (the compiled steps; eager's is kernels.paged_attention)
linear.py     eager's weight matmuls (oneDNN-packed where that is faster)
packed_rows.py one row times a packed weight, and an embedding lookup, read in place (the lone
              compiled step's matmuls, a tied model's embedding)
matvec.py     the lone compiled step's weight matmuls where oneDNN's layout is another
              (loops over cache-line blocks of a copy)
"""
