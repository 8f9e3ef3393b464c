"""The Index Service and the Placement Controller sharing one process (`kvsp index`)."""

import argparse

import httpx

from index import service
from kvsp_moq.web import serving


def test_combined_app_serves_both_and_shares_instance_status(tmp_path):
    p = argparse.ArgumentParser()
    service.configure_parser(p)
    args = p.parse_args(["--db", str(tmp_path / "pc.sqlite3"), "--block-tokens", "16"])
    app = service.create_combined_app(service.settings_from_args(args),
                                      service.pc_settings_from_args(args))
    status = {"instance": "http://127.0.0.1:1/", "epoch": 5, "state": "active", "ttl_ms": 60000,
              "prefill_tokens_per_s": 1000.0,
              "links": [{"holder": "http://127.0.0.1:2/", "mbit_per_s": 800.0, "rtt_us": 50}]}
    with serving(app) as url:
        from kvsp_moq.protocol.instances import instance_id

        r = httpx.put(f"{url}instances/{instance_id(status['instance'])}/status", json=status)
        assert r.status_code == 200 and r.json()["state"] == "active"
        # The IS now sees the instance for lookup targets: the PC's registry is its directory.
        assert app.state.index.settings.instances.get(status["instance"]).epoch == 5
        r = httpx.get(url + "instances")
        assert r.status_code == 200 and status["instance"] in r.text
        r = httpx.post(url + "lookup", json={"scope_id": "cc" * 16, "compat_id": "bb" * 32,
                                             "block_keys": ["aa" * 32],
                                             "targets": [status["instance"]]})
        assert r.status_code == 200 and r.json()["matched"] == 0
