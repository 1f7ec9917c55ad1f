"""How the computation is laid out over devices: the mesh (`mesh.py`), the logical-axis rules that
map model axis names onto it (`sharding.py`), where the train state lives (`placement.py`), how a
stack of layers runs (`stack.py`: one scan; `pipeline.py`: in stages), and the attention, expert
and context-parallel kernels the model calls. Model code names logical axes only, never a mesh
axis."""
