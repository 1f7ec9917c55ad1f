"""How arrays are laid out over devices: the mesh (`mesh.py`) and the logical-axis rules that map
model axis names onto it (`sharding.py`). Model code imports only `constrain` from here."""
