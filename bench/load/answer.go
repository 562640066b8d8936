package main

import (
	"bytes"
	"fmt"
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
)

// The response path of the response cells: after the request exchange the
// driver plays a decode engine's streamed chat answer as Envoy sends it to the
// ext_proc server in FULL_DUPLEX_STREAMED: the response headers, then one body
// chunk per event (vLLM flushes each token's event on its own), each sent once
// the previous one's reply is back, as tokens come one at a time. The events
// are vLLM's: a role event, the token events, the usage event and [DONE], the
// last with end_of_stream.

// decodeCachedTokens is what the decode engine reports as cached: the whole
// prompt, whose KV it pulled. The fake prefill reports fakePrefillCached.
const decodeCachedTokens = "1000"

// Answer is one streamed answer's messages, built once and shared by every
// stream (protobuf messages are safe for concurrent marshalling).
type Answer struct {
	headers *extprocv3.ProcessingRequest
	chunks  []*extprocv3.ProcessingRequest
}

// NewAnswer builds a streamed answer of tokens token events.
func NewAnswer(tokens int) *Answer {
	a := &Answer{headers: envoymsg.Headers(envoymsg.Response, false,
		envoymsg.Header{":status", "200"}, envoymsg.Header{"content-type", "text/event-stream; charset=utf-8"},
		envoymsg.Header{"cache-control", "no-cache"}, envoymsg.Header{"date", "Mon, 30 Nov 2026 10:00:00 GMT"},
		envoymsg.Header{"server", "uvicorn"}, envoymsg.Header{"x-envoy-upstream-service-time", "12"})}
	const head = `{"id":"chatcmpl-bench-0123456789abcdef","object":"chat.completion.chunk","created":1764496800,"model":"` + Model + `",`
	events := []string{head + `"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`}
	for i := range tokens {
		finish := "null"
		if i == tokens-1 {
			finish = `"length"`
		}
		events = append(events, fmt.Sprintf(`%s"choices":[{"index":0,"delta":{"content":" token%d"},"logprobs":null,"finish_reason":%s}]}`, head, i, finish))
	}
	events = append(events, head+fmt.Sprintf(`"choices":[],"usage":{"prompt_tokens":1000,"total_tokens":%d,"completion_tokens":%d,`+
		`"prompt_tokens_details":{"cached_tokens":%s}}}`, 1000+tokens, tokens, decodeCachedTokens), "[DONE]")
	for i, e := range events {
		a.chunks = append(a.chunks, envoymsg.Body(envoymsg.Response, []byte("data: "+e+"\n\n"), i == len(events)-1))
	}
	return a
}

// playAnswer sends a on s, each chunk after the previous one's reply, and
// returns how long each chunk took to come back and, with keep, the answer as
// the client gets it. Every chunk is a whole event, so each gets its reply.
func playAnswer(s extprocv3.ExternalProcessor_ProcessClient, a *Answer, keep bool) ([]time.Duration, []byte, error) {
	if err := s.Send(a.headers); err != nil {
		return nil, nil, err
	}
	if m, err := recvReply(s); err != nil {
		return nil, nil, err
	} else if m.GetResponseHeaders() == nil {
		return nil, nil, fmt.Errorf("response: want the headers reply, got %T", m.Response)
	}
	lat := make([]time.Duration, 0, len(a.chunks))
	var answer []byte
	for i, c := range a.chunks {
		t0 := time.Now()
		if err := s.Send(c); err != nil {
			return nil, nil, err
		}
		m, err := recvReply(s)
		if err != nil {
			return nil, nil, err
		}
		sr := m.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return nil, nil, fmt.Errorf("response chunk %d: want a streamed_response body reply, got %v", i, m)
		}
		lat = append(lat, time.Since(t0))
		if keep {
			answer = append(answer, sr.GetBody()...)
		}
		if last := i == len(a.chunks)-1; sr.GetEndOfStream() != last {
			return nil, nil, fmt.Errorf("response chunk %d: end_of_stream %v", i, sr.GetEndOfStream())
		}
	}
	return lat, answer, nil
}

// checkAnswer checks the answer the client got: byte for byte the engine's,
// but for cached_tokens, which says want.
func checkAnswer(a *Answer, got []byte, want string) error {
	var sent []byte
	for _, c := range a.chunks {
		sent = append(sent, c.GetResponseBody().GetBody()...)
	}
	expected := bytes.Replace(sent, []byte(`"cached_tokens":`+decodeCachedTokens), []byte(`"cached_tokens":`+want), 1)
	if !bytes.Equal(got, expected) {
		i := 0
		for i < min(len(got), len(expected)) && got[i] == expected[i] {
			i++
		}
		return fmt.Errorf("the answer differs from the engine's with cached_tokens %s at byte %d: %q", want, i,
			strings.TrimSpace(string(got[max(0, i-40):min(len(got), i+40)])))
	}
	return nil
}
