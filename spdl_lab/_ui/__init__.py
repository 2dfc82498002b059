"""Display layers: Bokeh figures and reports. They read frames and tables only."""
