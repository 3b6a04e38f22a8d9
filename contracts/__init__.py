"""Wire contracts shared by every ito-training service and the `ecc` client.

Pure data only: frozen msgspec Structs, enums and subject names. No logic, no I/O. A service
decodes bytes into these types at its edge and never touches raw dicts in its core.

Schema evolution (msgspec's rule): new fields get defaults; never retype or reorder a field;
a changed meaning is a new type.
"""
