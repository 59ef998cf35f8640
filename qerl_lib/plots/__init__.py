"""Figures, each made from a JSON the kit wrote (never from numbers typed into a notebook).

One module per topic (`first_look`, `quant`, `kernel`, `aqn`, `training`, ...), all on the ground
floor: they read JSON and write PNG through `style.save_figure`, and import nothing else of the kit.
"""
