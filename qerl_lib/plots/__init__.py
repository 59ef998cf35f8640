"""Floor 1, the figures: each drawn from a JSON the kit wrote, never from numbers typed into a notebook.
Ground floor: may import only the utilities (errors, io, paths); one module per topic, all through `style.save_figure`.
"""
