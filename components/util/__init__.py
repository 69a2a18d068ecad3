"""Helpers shared by the executors (like TFX's components/util): the Examples splits and how a
split is read (examples_io), the user's module file and its record decoder (user_module), and
Keras loss reductions (losses). Executors import these from here, never from each other."""
