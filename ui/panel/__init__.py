"""The live engine panel at /panel: header figures, plots of the last two minutes, the block map of
both KV pools, and the load generator's controls. Reads the engine only through snapshots."""
