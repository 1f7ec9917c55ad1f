"""How arrays are laid out over devices: the mesh (`mesh.py`), the logical-axis rules that map
model axis names onto it (`sharding.py`), and where the train state lives (`placement.py`). Model
code imports only `constrain` from here."""
