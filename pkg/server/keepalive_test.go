package server

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/net/http2"
)

// Envoy's connections are watched by pings both ways: a peer that answers no
// ping is dropped (its node lost: TCP alone would hold its streams for some 15
// minutes), and Envoy's own pings are taken as often as MinPeerPing allows,
// where grpc-go's default would close the connection, and every stream on it,
// with GOAWAY too_many_pings. A raw HTTP/2 peer on the gRPC port plays Envoy.
func TestKeepaliveWatchesTheConnection(t *testing.T) {
	tests := []struct {
		name      string
		keepalive Keepalive
		pingEvery time.Duration // the peer's own pings; 0: none, and it answers none
		want      string
	}{
		// grpc-go pings after a second of silence at the soonest.
		{"a silent peer that answers no ping is dropped", Keepalive{Ping: time.Second, Timeout: 100 * time.Millisecond}, 0, "closed"},
		// grpc-go's default (5 minutes) would answer these with GOAWAY too_many_pings.
		{"the peer's pings at the allowed pace keep it", Keepalive{MinPeerPing: 10 * time.Millisecond}, 100 * time.Millisecond, "kept"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := start(t, "connector: kv-nixl\npools: {decode: {endpoints: [\"10.0.0.2:8000\"]}}", Options{Keepalive: tt.keepalive}, logr.Discard())
			conn, err := net.Dial("tcp", r.grpcAddr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := conn.Write([]byte(http2.ClientPreface)); err != nil {
				t.Fatal(err)
			}
			fr := http2.NewFramer(conn, conn)
			if err := fr.WriteSettings(); err != nil {
				t.Fatal(err)
			}
			frames := make(chan http2.Frame)
			readErr := make(chan error, 1)
			done := make(chan struct{})
			defer close(done) // before the conn closes: frees the reader of a frame nobody takes
			go func() {
				for {
					f, err := fr.ReadFrame()
					if err != nil {
						readErr <- err
						return
					}
					select {
					case frames <- f:
					case <-done:
						return
					}
				}
			}()
			var pace <-chan time.Time
			if tt.pingEvery > 0 {
				ticker := time.NewTicker(tt.pingEvery) // the peer's ping rate, not synchronisation
				defer ticker.Stop()
				pace = ticker.C
			}
			bound := time.Second // the peer's ten pings at the allowed pace
			if tt.pingEvery == 0 {
				bound = 5 * time.Second // a bound: the close ends the wait
			}
			end := time.After(bound)
			got := "kept"
		loop:
			for {
				select {
				case <-pace:
					if err := fr.WritePing(false, [8]byte{1}); err != nil {
						got = "closed"
						break loop
					}
				case f := <-frames:
					switch f := f.(type) {
					case *http2.SettingsFrame:
						if !f.IsAck() {
							fr.WriteSettingsAck()
						}
					case *http2.GoAwayFrame:
						got = "goaway " + string(f.DebugData())
						if f.ErrCode == http2.ErrCodeEnhanceYourCalm && string(f.DebugData()) == "too_many_pings" {
							got = "too_many_pings"
						}
						break loop
					}
				case err := <-readErr:
					if !errors.Is(err, net.ErrClosed) {
						got = "closed"
					}
					break loop
				case <-end:
					if tt.pingEvery == 0 {
						got = "still open after " + bound.String() + " without answering a ping"
					}
					break loop
				}
			}
			if got != tt.want {
				t.Errorf("the connection was %s, want %s", got, tt.want)
			}
		})
	}
}
