"""The web page's static parts (HTML, CSS, JS), package data assembled by :mod:`service.ui.page`."""
