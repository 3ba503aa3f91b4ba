"""autobatch's HTTP service: plans, profiles, probe runs and GPU inventory, as a JSON API.

The service only parses, calls the library and serialises; the logic lives in ``autobatch``.

Example::

    from service.main import create_app, run
    from service.web.settings import Settings

    run(Settings(port=8080, config_file="models.toml"))     # what `autobatch serve` does
    app = create_app(Settings(store_path=":memory:"))       # for TestClient or another ASGI server
"""

from autobatch.extras import EXTRAS, require

for _module in EXTRAS["service"]:  # a missing one is one line naming the extra
    require(_module, extra="service", purpose="the autobatch service")
