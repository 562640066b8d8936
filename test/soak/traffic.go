package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
)

// Outcome classes.
const (
	okClass          = "ok"
	badInputClass    = "expected: 4xx for a bad input"
	gaveUpClass      = "expected: client gave up"
	decodeKillClass  = "expected: decode engine killed (503 or cut stream)"
	shedClass        = "expected: may be shed, refused after its hold while saturated (429)"
	unexpectedPrefix = "UNEXPECTED: "
)

// knownIssues are the answers of known product limits (docs/reliability.md),
// counted apart so that they stay visible: a connector's answer of that
// status whose body says text is of that class.
var knownIssues = []struct {
	connector string
	status    int
	text      string
	class     string
}{
	// A kv-sglang or kv-mooncake prefill leg runs beside its decode request
	// and is not retried: when the injected 503 hits it, extproc answers the
	// request with 502 and Envoy resets the decode request.
	{"kv-sglang", http.StatusBadGateway, "prefill leg failed", "known issue: kv-sglang prefill leg failed (502 at once, decode reset)"},
	{"kv-mooncake", http.StatusBadGateway, "prefill leg failed", "known issue: kv-mooncake prefill leg failed (502 at once, decode reset)"},
	// The same before extproc called the decode back: the decode engine
	// waits for a bootstrap handshake (SGLang) or the blocks (Mooncake)
	// that never come and answers 500 after its timeout. Still possible
	// where the call-back loses a race.
	{"kv-sglang", http.StatusInternalServerError, "bootstrap handshake", "known issue: kv-sglang prefill leg failed, decode timed out (500)"},
	{"kv-mooncake", http.StatusInternalServerError, "Timeout waiting for P side ready", "known issue: kv-mooncake prefill leg failed, decode timed out (500)"},
	// A kv-sglang leg that fails because its decode partner died is blamed on
	// the prefill endpoint; once both prefills are ejected extproc goes
	// decode-only, which an SGLang decode server refuses.
	{"kv-sglang", http.StatusBadRequest, "bootstrap_room is required", "known issue: kv-sglang decode-only refused by the SGLang decode (400)"},
	// The other way round: a decode that answers 500 because its prefill leg
	// failed is ejected by the response-path status.
	{"kv-sglang", http.StatusServiceUnavailable, "every endpoint is unhealthy", "known issue: kv-sglang decode pool ejected for its prefills' failures (503)"},
}

// knownIssue is the class of a connector's answer among knownIssues, "" for none.
func knownIssue(connector string, status int, body string) string {
	for _, k := range knownIssues {
		if k.connector == connector && k.status == status && strings.Contains(body, k.text) {
			return k.class
		}
	}
	return ""
}

var client = &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 64, DisableCompression: true}}

// drive keeps o.concurrency requests in flight until ctx ends or d passes.
func drive(ctx context.Context, stacks []*stack, o options, st *stats, d time.Duration, withBad bool) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var wg sync.WaitGroup
	for w := range o.concurrency {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for ctx.Err() == nil {
				one(stacks[rng.IntN(len(stacks))], rng, o, st, withBad)
			}
		})
	}
	wg.Wait()
}

// one sends one request and classifies what came back.
func one(s *stack, rng *rand.Rand, o options, st *stats, withBad bool) {
	mode := []string{"full_duplex", "buffered"}[rng.IntN(2)]
	stream := rng.IntN(2) == 0
	chat := rng.IntN(2) == 0
	size := "small prompt"
	prompt := fmt.Sprintf("soak %d %s", rng.Int64(), s.connector)
	if o.bigEvery > 0 && rng.IntN(o.bigEvery) == 0 {
		size, prompt = "1MiB prompt", prompt+" "+strings.Repeat("lorem ipsum ", (1<<20)/12)
	}
	q, _ := json.Marshal(prompt)
	path, body := "/v1/completions", fmt.Sprintf(`{"model":"pdsim","prompt":%s,"stream":%v,"max_tokens":6}`, q, stream)
	if chat {
		path, body = "/v1/chat/completions", fmt.Sprintf(`{"model":"pdsim","messages":[{"role":"user","content":%s}],"stream":%v,"max_tokens":6}`, q, stream)
	}
	bad := ""
	if withBad {
		switch rng.IntN(50) {
		case 0:
			bad, body = "invalid JSON", `{"model":"pdsim","prompt":`
		case 1:
			bad, path = "unknown path", "/flush_cache" // an engine admin path: the API table refuses it
		case 2:
			bad = "gives up"
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if bad == "gives up" {
		ctx, cancel = context.WithTimeout(ctx, time.Duration(1+rng.IntN(20))*time.Millisecond)
		defer cancel()
	}
	start := time.Now()
	class, detail := okClass, ""
	defer func() { st.add(class, size, time.Since(start), detail) }()

	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.proxies[mode].URL()+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	sheddable := rng.IntN(8) == 0
	if sheddable {
		req.Header.Set("X-Gateway-Inference-Objective", soakObjective)
		req.Header.Set("X-Gateway-Inference-Fairness-Id", fmt.Sprintf("tenant-%d", rng.IntN(3))) // flows that take turns in the hold
		size = "may be shed (time held included)"
	}
	resp, err := client.Do(req)
	var got []byte
	if err == nil {
		got, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	end := time.Now()
	desc := fmt.Sprintf("%s %s %s stream=%v %s", s.connector, mode, path, stream, size)
	complete := err == nil && resp.StatusCode == http.StatusOK && whole(string(got), stream)
	switch {
	case bad == "gives up" && (errors.Is(err, context.DeadlineExceeded) || complete):
		class = gaveUpClass
	case bad == "invalid JSON" && err == nil && resp.StatusCode == http.StatusBadRequest,
		bad == "unknown path" && err == nil && resp.StatusCode == http.StatusNotFound:
		class = badInputClass
	case bad == "" && complete:
	case sheddable && err == nil && resp.StatusCode == http.StatusTooManyRequests && s.saturated.overlaps(start, end) && strings.Contains(string(got), "may be shed"):
		class = shedClass
	case s.kills.overlaps(start, end) && (err != nil || resp.StatusCode == http.StatusServiceUnavailable || (resp.StatusCode == http.StatusOK && !whole(string(got), stream))):
		class = decodeKillClass
	case err == nil && knownIssue(s.connector, resp.StatusCode, string(got)) != "":
		class = knownIssue(s.connector, resp.StatusCode, string(got))
	case err != nil:
		class, detail = unexpectedPrefix+"transport error", fmt.Sprintf("%s: %v", desc, err)
	default:
		class = unexpectedPrefix + "status " + strconv.Itoa(resp.StatusCode)
		if resp.StatusCode == http.StatusOK {
			class = unexpectedPrefix + "incomplete answer"
		}
		detail = fmt.Sprintf("%s (bad input: %q): %d %s %.200s", desc, bad, resp.StatusCode, resp.Header.Get(envoyemu.DetailsHeader), got)
	}
}

// whole reports whether a completion came back complete.
func whole(body string, stream bool) bool {
	if stream {
		return strings.HasPrefix(body, "data: ") && strings.HasSuffix(body, "data: [DONE]\n\n")
	}
	var c struct {
		Choices []json.RawMessage `json:"choices"`
	}
	return json.Unmarshal([]byte(body), &c) == nil && len(c.Choices) == 1
}
