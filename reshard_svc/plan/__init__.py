"""Pure plans, computed identically on every rank from metadata alone: the conversion
spec, placement rules, what a save writes, what a load or convert reads and moves, what
an output folder holds, and what a live transfer sends. Nothing here touches a process
group or storage."""
