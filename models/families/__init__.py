"""Model families: the types and facts a family's stages share, read from the model folder.

A stage imports its family's module, never another stage's adapter, and never a builder: the
builders in `stagemesh.models` write folders in the family's layout, these modules read them.
"""
