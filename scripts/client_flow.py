"""The onboarding flow and a notification's life, through a client generated from openapi.yaml.

Run by scripts/client-check.sh against a running `cifpool serve`: reserve, look up, confirm; reserve,
release; enqueue a scheduled notification, look it up, cancel it; and the audit page and pool stats.
Every answer is parsed by the generated models, so a field the service sends and the contract lacks
(or the reverse) fails here. Usage: client_flow.py BASE_URL API_KEY
"""

import datetime
import sys

from cifpool_client import AuthenticatedClient
from cifpool_client.api.admin import search_audit
from cifpool_client.api.cif import confirm_cif, get_cif, release_cif, reserve_cif
from cifpool_client.api.notifications import cancel_notification, enqueue_notification, get_notification
from cifpool_client.api.pools import list_pools
from cifpool_client.models import (
    Accepted,
    AuditPage,
    CodeStatus,
    Confirmed,
    ConfirmRequest,
    JobView,
    NewJob,
    PoolsResponse,
    Released,
    Reservation,
    ReserveRequest,
    TokenRequest,
)


def expect(value, kind, what):
    if not isinstance(value, kind):
        raise SystemExit(f"{what}: expected {kind.__name__}, got {value!r}")
    return value


def main(base_url: str, api_key: str) -> None:
    client = AuthenticatedClient(base_url=base_url, token=api_key, raise_on_unexpected_status=True)

    # Onboarding: reserve, look up, confirm.
    held = expect(
        reserve_cif.sync(client=client, body=ReserveRequest(customer_type="individual"), x_holder="client-check"),
        Reservation,
        "reserve",
    )
    status = expect(get_cif.sync(held.cif, client=client), CodeStatus, "look up")
    assert status.state == "reserved", status
    done = expect(
        confirm_cif.sync(
            held.cif,
            client=client,
            body=ConfirmRequest(reservation_token=held.reservation_token, customer_ref="crm-client-check"),
        ),
        Confirmed,
        "confirm",
    )
    assert done.state == "used", done
    # A second reservation, given back.
    other = expect(reserve_cif.sync(client=client, body=ReserveRequest(customer_type="individual")), Reservation, "reserve")
    released = expect(
        release_cif.sync(other.cif, client=client, body=TokenRequest(reservation_token=other.reservation_token)),
        Released,
        "release",
    )
    assert released.state == "available", released
    pools = expect(list_pools.sync(client=client), PoolsResponse, "pools")
    assert any(p.customer_type == "individual" and p.used >= 1 for p in pools.pools), pools

    # A notification: scheduled for tomorrow, looked up, canceled.
    tomorrow = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    job = NewJob(
        class_="transactional",
        tenant="client-check",
        recipient="+84900000042",
        payload={"text": "statement ready"},
        run_at=tomorrow,
    )
    accepted = expect(enqueue_notification.sync(client=client, body=job), Accepted, "enqueue")
    seen = expect(get_notification.sync(accepted.id, client=client), JobView, "look up the job")
    assert str(seen.status) == "scheduled", seen
    canceled = expect(cancel_notification.sync(accepted.id, client=client), JobView, "cancel")
    assert str(canceled.status) == "canceled", canceled

    audit = expect(search_audit.sync(client=client, cif=held.cif), AuditPage, "audit")
    actions = [str(e.action) for e in audit.events]
    assert "cif.confirmed" in actions and "cif.reserved" in actions, actions
    print(f"client flow passed: {held.cif} confirmed, {other.cif} released, job {accepted.id} canceled")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
