"""The side-channel patch. 0.5.18 to 0.5.23 (``side_channels_patch``): ZMQ rank ports admit only authenticated,
well-formed messages; the sockets to peers sign; listener loops restart; the manager's peer sockets are capped.
0.4.9.post6, 0.4.10.post2 and 0.5.10.post1 (``early_side_channels_patch``): the same auth frame on every message and
the same restarts; no wire rules (they describe 0.5.18+'s messages) and no cap (these managers keep no socket cache
to cap)."""
from common_text import _SG, CONN, LIFECYCLEMOD, MOONCAKE, NIXL, with_bundle

SIDEMOD = _SG.source_file(f"{_SG.PD}.common.pd_side_channels")
MORI = _SG.source_file(_SG.MORI)
STAGING = _SG.source_file(_SG.STAGING_HANDLER)
PP_STORE = _SG.source_file(_SG.PP_CONSENSUS)
# names the text above the bundle mark defines for the bundled modules (the plugin's zmq_settings, events, config)
PROVIDED = ("StrEnum", "Keyring", "Mode", "events", "auth_state", "side_mode")
PD_SIDE_CHANNELS = with_bundle("pd_side_channels.py", PROVIDED)

H_SIDE = """\
sglang-harden backport: authenticate and check the PD ZMQ side channels

What: a new module sglang/srt/disaggregation/common/pd_side_channels.py. Every KV manager's rank
port (the PULL socket where decode registers with prefill and sends transfer infos and abort
notices, and where prefill sends statuses, aux data and drain acks) admits a message only after:
- with the control-plane secret (SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE, the authenticate-control-plane
  patch's), an auth frame appended as the last frame: HMAC-SHA256 over the destination rank port,
  the sender's instance id, a timestamp, a per-destination sequence number and every other frame;
  stale messages and replays (a window per sender) are refused; the frame is removed before SGLang
  reads the message. Every socket SGLang connects to a peer's rank port signs (the manager's, the
  receivers', MORI's, the staging prefetch socket);
- the wire rules of the manager's backend and role: what its listener can read, and who may say
  what (a registration is replaced only by its registrant, an AUX_DATA write stays in its buffer,
  an abort's reply address is one of the room's);
A refused message is counted, logged (rate-limited) and dropped. A listener loop that raises is
started again; the manager's sockets to peers are capped (an abort names any address it likes).
SGLANG_HARDEN_ZMQ_AUTH=enforce|log|off (default enforce with a secret; enforce without one refuses
to start), SGLANG_HARDEN_ZMQ_SIGN=1|0 (0: sign nothing, the first step of a rollout),
SGLANG_HARDEN_SIDE_CHANNELS=enforce|log|off (the rules, restarts and cap; default enforce).
The auth frame and the checks are the sglang-harden plugin's: patched and plugin nodes interoperate.

Why: every frame that reached a rank port was trusted. A forged registration redirects another
tenant's KV, a one-frame message ends a listener thread for good (the node then serves no PD
request), a forged AUX_DATA index makes decode write outside its buffers (SIGSEGV).
"""

IMPORT = "from sglang.srt.disaggregation.common import pd_side_channels  # sglang-harden backport\n"
BACKEND_IMPORT = "\nfrom sglang.srt.disaggregation.common.conn import (\n"
BIND = ("        self.rank_port, self.server_socket = get_zmq_socket_on_host(\n"
        "            self._zmq_ctx, zmq.PULL, host=self.local_ip\n"
        "        )\n")
MANAGER_CONNECT = "            sock.connect(endpoint)\n            self._socket_cache[endpoint] = sock\n"
RECEIVER_CONNECT = "                sock.connect(endpoint)\n                cls._socket_cache[endpoint] = sock\n"
MORI_CONNECT = "            sock.connect(endpoint)\n            cache[endpoint] = sock\n"
STAGING_CONNECT = "                    sock.connect(ep)\n                    prefetch_sockets[ep] = sock\n"
SEND_LOCKED = "        sock = self._connect(endpoint, is_ipv6=is_ipv6)\n"
POLLED = "        poller.register(socket, zmq.POLLIN)\n"
SIGN = "pd_side_channels.sign_socket(sock, {endpoint})  # sglang-harden backport: it signs what it sends\n"


def _sign_after(rel: str, anchor: str, endpoint: str) -> tuple:
    first, _, rest = anchor.partition("\n")
    indent = first[:len(first) - len(first.lstrip())]
    return (rel, anchor, f"{first}\n{indent}{SIGN.format(endpoint=endpoint)}{rest}")


def _listener(rel: str, name: str, rest: str) -> tuple:
    """``threading.Thread(target=<name><rest>`` starts the loop under ``restarting_listener``."""
    return (rel, f"threading.Thread(target={name}{rest}",
            f"threading.Thread(target=pd_side_channels.restarting_listener({name}){rest}")


def _pp_store_edits() -> list:
    """PP rank 0's consensus-store socket verifies, the other PP ranks' sockets sign (0.5.22+)."""
    listening = '            logger.info("PPConsensusStore is listening at %s:%d", host, port)\n'
    connected = '            logger.info("PPConsensusStore connected to %s:%d", host, port)\n'
    return [
        (PP_STORE, "\nlogger = logging.getLogger(__name__)\n", "\n" + IMPORT + "\nlogger = logging.getLogger(__name__)\n"),
        (PP_STORE, listening, listening + "            # sglang-harden backport: the other PP ranks' messages are signed\n"
         "            pd_side_channels.guard_pp_store(self._socket, host, port)\n"),
        (PP_STORE, connected, connected + "            # sglang-harden backport: it signs what it sends\n"
         '            pd_side_channels.sign_socket(self._socket, f"{host}:{port}")\n'),
    ]


def side_channels_patch(daemon_threads: bool, polled_recv: bool, nixl_bootstrap: str = "bootstrap_thread",
                        nixl_decode: str = "decode_listener_thread", pp_store: bool = False) -> tuple[str, str, list]:
    """``daemon_threads``: Mooncake starts its listeners as daemons (0.5.21+); ``polled_recv``: the rank port is
    read through ``_make_worker_recv`` (0.5.21+); the NIXL listeners' names (0.5.21+: ``bootstrap_thread_guarded``;
    0.5.18: ``decode_staging_thread``); ``pp_store``: the release has the PP consensus store (0.5.22+)."""
    mooncake_rest = ", daemon=True)" if daemon_threads else ")"
    edits = [
        (SIDEMOD, None, PD_SIDE_CHANNELS),
        (CONN, "from sglang.srt.disaggregation.common import pd_auth, pd_rejections\n",
         "from sglang.srt.disaggregation.common import pd_auth, pd_rejections, pd_side_channels\n"),
        (CONN, BIND, BIND + "        # sglang-harden backport: the rank port admits only authenticated, well-formed messages\n"
         "        pd_side_channels.guard_rank_port(self)\n"),
        _sign_after(CONN, MANAGER_CONNECT, "endpoint"),
        (CONN, SEND_LOCKED, SEND_LOCKED + "        pd_side_channels.cap_sockets(self, endpoint)  # sglang-harden backport\n"),
        _sign_after(CONN, RECEIVER_CONNECT, "endpoint"),
        *([(CONN, POLLED, POLLED + "        pd_side_channels.returns_none_when_polled(socket)  # sglang-harden\n")]
          if polled_recv else []),
        (STAGING, "\nlogger = logging.getLogger(__name__)\n", "\n" + IMPORT + "\nlogger = logging.getLogger(__name__)\n"),
        _sign_after(STAGING, STAGING_CONNECT, "ep"),
        (MORI, BACKEND_IMPORT, "\n" + IMPORT + BACKEND_IMPORT[1:]),
        (MORI, MORI_CONNECT, "            sock.connect(endpoint)\n"
         "            pd_side_channels.sign_socket(sock, endpoint)  # sglang-harden backport: it signs what it sends\n"
         "            cache[endpoint] = sock\n"
         "            pd_side_channels.cap_thread_sockets(cache, endpoint)  # sglang-harden backport\n"),
        _listener(MORI, "bootstrap_worker", ", daemon=True)"),
        _listener(MORI, "decode_worker", ", daemon=True)"),
    ]
    for rel, listeners in ((MOONCAKE, (("bootstrap_thread", mooncake_rest), ("decode_thread", mooncake_rest))),
                           (NIXL, ((nixl_bootstrap, ")"), (nixl_decode, ", daemon=True)")))):
        edits.append((rel, BACKEND_IMPORT, "\n" + IMPORT + BACKEND_IMPORT[1:]))
        edits += [_listener(rel, name, rest) for name, rest in listeners]
    header = H_SIDE
    if pp_store:
        edits += _pp_store_edits()
        header = H_SIDE.replace("\nWhy:", "The PP consensus store's socket (PP rank 0 with --pp-size > 1, where the other PP\n"
                                "ranks replicate each room's status) verifies the same auth frame; their sockets sign.\n\nWhy:")
        assert header != H_SIDE
    return ("authenticate-side-channels", header, edits)


H_SIDE_EARLY = H_SIDE.replace("""- the wire rules of the manager's backend and role: what its listener can read, and who may say
  what (a registration is replaced only by its registrant, an AUX_DATA write stays in its buffer,
  an abort's reply address is one of the room's);
""", "").replace("""started again; the manager's sockets to peers are capped (an abort names any address it likes).
""", """started again. This release has no wire rules (they describe 0.5.18+'s messages): a holder of the
secret is trusted to send well-formed messages; a listener it crashes is started again. The drain
acknowledgement the page-lifecycle patch sends (SGH_ABORT_ACK) signs too.
""").replace("SGLANG_HARDEN_SIDE_CHANNELS=enforce|log|off (the rules, restarts and cap; default enforce).",
             "SGLANG_HARDEN_SIDE_CHANNELS=enforce|log|off (the restarts; default enforce).")
assert H_SIDE_EARLY.count("wire rules") == 1 and "restarts; default" in H_SIDE_EARLY

MANAGER_NEW_SOCKET = "        socket.connect(endpoint)\n        return socket\n"
ACK_SOCKET = "        sock.connect(endpoint)\n    except Exception:\n"


def _sign_new_socket(rel: str) -> tuple:
    """The manager's ``_connect`` opens a new socket per call (0.4.x; 0.5.10.post1 caches it per endpoint)."""
    return (rel, MANAGER_NEW_SOCKET, "        socket.connect(endpoint)\n"
            "        pd_side_channels.sign_socket(socket, endpoint)  # sglang-harden backport: it signs what it sends\n"
            "        return socket\n")


def early_side_channels_patch(import_edit: tuple, bind: str, manager_rel: str,
                              listeners: list[tuple[str, str, str]], staging: bool) -> tuple[str, str, list]:
    """Releases before 0.5.18 (the page-lifecycle patch's own ``SGH_ABORT``/``SGH_ABORT_ACK`` included).
    ``import_edit``: where ``pd_side_channels`` is imported beside ``pd_auth``; ``bind``: the rank port's bind;
    ``manager_rel``: the file of the manager's and the receiver's ``_connect``; ``listeners``: (file, loop name,
    rest of the ``Thread(...)`` call); ``staging``: the release has the staging prefetch socket."""
    edits = [
        (SIDEMOD, None, PD_SIDE_CHANNELS),
        import_edit,
        (manager_rel, bind, bind + "        # sglang-harden backport: the rank port admits only authenticated messages\n"
         "        pd_side_channels.guard_rank_port(self, wire_rules=False)\n"),
        _sign_new_socket(manager_rel),
        _sign_after(manager_rel, RECEIVER_CONNECT, "endpoint"),
        (LIFECYCLEMOD, ACK_SOCKET, "        sock.connect(endpoint)\n"
         "        from sglang.srt.disaggregation.common import pd_side_channels  # sglang-harden: the ack signs\n"
         "        pd_side_channels.sign_socket(sock, endpoint)\n    except Exception:\n"),
    ]
    if staging:
        edits += [(STAGING, "\nlogger = logging.getLogger(__name__)\n",
                   "\n" + IMPORT + "\nlogger = logging.getLogger(__name__)\n"),
                  _sign_after(STAGING, STAGING_CONNECT, "ep")]
    for rel in dict.fromkeys(rel for rel, _, _ in listeners):
        if rel != manager_rel:
            edits.append((rel, BACKEND_IMPORT, "\n" + IMPORT + BACKEND_IMPORT[1:]))
    edits += [_listener(rel, name, rest) for rel, name, rest in listeners]
    return ("authenticate-side-channels", H_SIDE_EARLY, edits)
