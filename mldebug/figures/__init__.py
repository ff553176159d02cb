"""What every surface draws the same way, whichever front end shows it: the graph's rows
(graph_rows.py, no bokeh) and its Bokeh figure (graph_figure.py), used by the browser view
(mldebug/view), the VS Code panel's JSON (mldebug/dap) and the notebook display. One layer
below the front ends, so that each imports it and none imports another."""
