#!/usr/bin/env bash
# Regenerate docs/dashboard-actors.png: the Ray dashboard's Actors page during a real
# elastic-llm training run (tiny model, 4 stages x 2 replicas on one loopback node).
#
#   bash docs/screenshot.sh            # from anywhere; writes docs/dashboard-actors.png
#
# Needs: ray[default] (2.60, token auth), chromium, aiohttp (a Ray dependency).
# Everything stays on 127.0.0.1: a private head (own temp dir and ports, so other
# Ray clusters on the machine are untouched), the job, and a headless Chromium that
# is driven over the DevTools protocol and cannot resolve or reach any other host.
# On exit (also on error or Ctrl-C) it stops the job, Chromium and exactly the Ray
# processes it started (those under $RAY_TMP or talking to its GCS port).
set -euo pipefail

export RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/docs/dashboard-actors.png}
RAY_TMP=${RAY_TMP:-/tmp/rayshot}
GCS_PORT=${GCS_PORT:-6395}
DASH_PORT=${DASH_PORT:-8295}
CDP_PORT=${CDP_PORT:-9395}
DASH=http://127.0.0.1:$DASH_PORT
# 1400x1150 PNG rendered at 0.75 scale (page laid out 1867 px wide) so that all
# 11 actors and the Repr column fit.
SHOT_W=${SHOT_W:-1400} SHOT_H=${SHOT_H:-1150} SHOT_SCALE=${SHOT_SCALE:-0.75}

# the token the dashboard checks (same lookup order as Ray)
TOKEN=${RAY_AUTH_TOKEN:-$(cat "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}")}

JOB= CHROME_PID= CHROME_DIR=
descendants() { local p; for p in $(pgrep -P "$1" || true); do echo "$p"; descendants "$p"; done; }
kill_trees() {  # kill_trees PID...: SIGTERM the processes and their descendants, SIGKILL stragglers
    local all="" p i
    for p in "$@"; do all="$all $p $(descendants "$p")"; done
    [ -n "${all// /}" ] || return 0
    kill -TERM $all 2>/dev/null || true
    for i in $(seq 32); do  # the grace period of `ray stop` (16 s)
        any_alive $all || return 0
        sleep 0.5
    done
    kill -KILL $all 2>/dev/null || true
}
any_alive() { ps -o stat= -p "$(echo $* | tr ' ' ,)" 2>/dev/null | grep -qv '^Z'; }  # zombies count as gone
ray_roots() {  # this head's processes (the rest are their children); never our own shell
    pgrep -f -- "$RAY_TMP/session_|--address=127\.0\.0\.1:$GCS_PORT( |$)" | grep -vx "$$" || true
}
cleanup() {
    set +e
    [ -n "$JOB" ] && ray job stop --address "$DASH" "$JOB" >/dev/null 2>&1
    [ -n "$CHROME_PID" ] && kill_trees "$CHROME_PID"
    [ -n "$CHROME_DIR" ] && rm -rf "$CHROME_DIR"
    kill_trees $(ray_roots)
    echo "stopped job, chromium and the Ray head under $RAY_TMP"
}
trap cleanup EXIT

if [ -n "$(ray_roots)" ]; then echo "a Ray head under $RAY_TMP (or on port $GCS_PORT) is already running" >&2; trap - EXIT; exit 1; fi

echo "== starting a loopback Ray head (dashboard $DASH)"
ray start --head --node-ip-address=127.0.0.1 --port="$GCS_PORT" --num-cpus=4 \
    --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" --include-dashboard=true \
    --temp-dir="$RAY_TMP" --ray-client-server-port=10395 \
    --dashboard-agent-listen-port=52395 --dashboard-agent-grpc-port=52396 \
    --runtime-env-agent-port=52397 --metrics-export-port=52398 \
    --node-manager-port=52399 --object-manager-port=52400 \
    --min-worker-port=23000 --max-worker-port=23999 >/dev/null

echo "== submitting a tiny run (4 stages x 2 replicas)"
cd "$ROOT"
for i in $(seq 60); do   # the job agent needs a few seconds after `ray start`
    if JOB=$(python3 -m elastic_llm.cli submit --config jobs/tiny.yaml --address "$DASH" \
            --max-steps 3000 --set parallel.dp=2 --set parallel.cpus_per_actor=0.25 \
            --set train.eval_every=0 2>/dev/null | tail -n 1)  # stdout: the job id
    then break; fi
    JOB=
    sleep 2
done
[ -n "$JOB" ] || { echo "could not submit the run" >&2; exit 1; }
echo "   job $JOB"

echo "== waiting until it trains"
for i in $(seq 180); do
    step=$(python3 -m elastic_llm.cli status --address "127.0.0.1:$GCS_PORT" --json 2>/dev/null |
        python3 -c 'import json,sys; print(max([r["status"].get("step") or 0 for r in json.load(sys.stdin)["runs"]] or [0]))' 2>/dev/null || echo 0)
    [ "$step" -gt 5 ] && break
    sleep 2
done
[ "$step" -gt 5 ] || { echo "the run did not start training" >&2; exit 1; }
python3 -m elastic_llm.cli status --address "127.0.0.1:$GCS_PORT" | head -1

echo "== screenshot of $DASH/#/actors"
CHROME_DIR=$(mktemp -d /tmp/rayshot-chrome.XXXXXX)
# no DNS except 127.0.0.1, a dead proxy for anything not on loopback, no background services
chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars \
    --remote-debugging-address=127.0.0.1 --remote-debugging-port="$CDP_PORT" \
    --user-data-dir="$CHROME_DIR" --no-first-run --disable-sync --disable-default-apps \
    --disable-background-networking --disable-component-update --disable-domain-reliability \
    --host-resolver-rules="MAP * ~NOTFOUND, EXCLUDE 127.0.0.1" --proxy-server=http://127.0.0.1:9 \
    about:blank >"$CHROME_DIR/chrome.log" 2>&1 &
CHROME_PID=$!

TOKEN=$TOKEN python3 - "$CDP_PORT" "$DASH" "$OUT" "$SHOT_W" "$SHOT_H" "$SHOT_SCALE" <<'PY'
import asyncio, base64, os, sys, time
import aiohttp

cdp_port, dash, out = sys.argv[1], sys.argv[2], sys.argv[3]
W, H, SCALE = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])

# Actors page: 20 rows per page (all actors on one page) and oldest first
# (job supervisor, run monitor, snapshot manager, then the stages).
SETUP_JS = """(() => {
  const size = [...document.querySelectorAll('input')]
    .find(i => i.closest('.MuiFormControl-root')?.innerText.includes('Page Size'));
  Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(size, '20');
  size.dispatchEvent(new Event('input', {bubbles: true}));
  document.querySelector('input[type=checkbox]').click();  // Sort By Uptime: Reverse
})()"""

async def main():
    async with aiohttp.ClientSession() as http:
        for _ in range(150):
            try:
                async with http.get(f"http://127.0.0.1:{cdp_port}/json/list") as r:
                    pages = [t for t in await r.json() if t["type"] == "page"]
                if pages:
                    break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        else:
            sys.exit("chromium's DevTools endpoint never came up")
        async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            n = 0
            async def call(method, **params):
                nonlocal n
                n += 1
                await ws.send_json({"id": n, "method": method, "params": params})
                while True:
                    msg = await ws.receive_json()
                    if msg.get("id") == n:
                        if "error" in msg:
                            raise RuntimeError(f"{method}: {msg['error']}")
                        return msg.get("result", {})
            async def text():
                r = await call("Runtime.evaluate", returnByValue=True,
                               expression="document.body ? document.body.innerText : ''")
                return r["result"].get("value", "")
            await call("Network.enable")
            # The dashboard's login dialog POSTs the token to /api/authenticate, which
            # answers with this HttpOnly cookie; set the cookie directly instead.
            await call("Network.setCookie", name="ray-authentication-token",
                       value=os.environ["TOKEN"], url=dash + "/", httpOnly=True, sameSite="Strict")
            await call("Emulation.setDeviceMetricsOverride", width=round(W / SCALE),
                       height=round(H / SCALE), deviceScaleFactor=SCALE, mobile=False)
            await call("Page.navigate", url=dash + "/#/actors")
            async def wait_for(*needles, timeout=90):
                deadline = time.time() + timeout
                while True:
                    page = await text()
                    if all(s in page for s in needles):
                        return
                    if time.time() > deadline:
                        sys.exit(f"{needles} never showed up on the Actors page")
                    await asyncio.sleep(1)
            await wait_for("Stage(")
            await call("Runtime.evaluate", expression=SETUP_JS)
            await wait_for("Stage(", "SnapshotManager(", "Run(", "JobSupervisor")
            await asyncio.sleep(3)
            shot = await call("Page.captureScreenshot", format="png")
            with open(out, "wb") as f:
                f.write(base64.b64decode(shot["data"]))
            await call("Browser.close")

asyncio.run(main())
PY
wait "$CHROME_PID" 2>/dev/null || true; CHROME_PID=
echo "wrote $OUT ($(stat -c %s "$OUT") bytes)"
